"""The README's "Try it" lines run as written: the Python that makes the example files, every CLI
line, and the Python client blocks, against a live worker serving the built-in ``tiny`` model.

``/tmp/`` becomes a directory of the test's own and ``127.0.0.1:50051`` the worker's address; the
CLI finds the worker through ``DIFFUSION_TARGET``, as the README says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import REPO, start_worker

README_TARGET = "127.0.0.1:50051"
README_CLI = ".venv/bin/diffusion"


def readme_blocks(language: str) -> list[str]:
    """The README's fenced blocks of ``language``, up to the first section after "Try it"."""
    text = (REPO / "README.md").read_text()
    try_it = text.split("## Try it", 1)[1].split("\n## ", 1)[0]
    return [block for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", try_it, flags=re.S | re.M)
            if lang == language]


@pytest.fixture(scope="module")
def worker(runner, tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("readme-logs"), runner.target, "--model", "tiny")
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The README's working directory, with ``.venv/bin/diffusion`` where the README calls it."""
    work = tmp_path_factory.mktemp("readme-examples")
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / README_CLI).symlink_to(Path(sys.executable).parent / "diffusion")
    return work


def rewrite(code: str, worker, workdir: Path) -> str:
    return code.replace("/tmp/", f"{workdir}/files/").replace('"/tmp"', f'"{workdir}/files"').replace(
        README_TARGET, worker.target)


def run_python(code: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_try_it_lines_run_as_written(worker, workdir):
    make_files, *client_blocks = readme_blocks("python")
    (workdir / "files").mkdir()
    made = run_python(rewrite(make_files, worker, workdir), workdir)
    assert made.returncode == 0, made.stderr
    assert {p.name for p in (workdir / "files").iterdir()} == {"unet-update.safetensors", "style-lora.safetensors",
                                                                "mask.png"}

    [shell] = readme_blocks("sh")
    lines = [line.split("#", 1)[0].strip() for line in shell.splitlines() if line.strip()]
    assert all(line.startswith(f"{README_CLI} ") for line in lines), lines
    env = {**os.environ, "DIFFUSION_TARGET": worker.target}
    for line in lines:
        done = subprocess.run(["bash", "-c", rewrite(line, worker, workdir)], cwd=workdir, capture_output=True,
                              text=True, timeout=300, env=env)
        if line.endswith(" health") and "sleep" in lines[lines.index(line) - 1]:
            assert done.returncode == 1, f"{line}: the README says exit 1 while asleep\n{done.stderr}"
        elif line.endswith(" cancel REQUEST_ID"):
            assert done.returncode != 0 and "REQUEST_ID" in done.stderr, f"{line}\n{done.stderr}"
        else:
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    for name in ("fox.png", "snowy.png", "patched.png"):
        assert (workdir / name).stat().st_size > 0

    assert len(client_blocks) >= 2
    for block in client_blocks:
        done = run_python(rewrite(block, worker, workdir), workdir)
        assert done.returncode == 0, f"{block}\n{done.stdout}\n{done.stderr}"
