"""The CLI lines and the Python client blocks of the README and docs/ run as written, in the order
each page shows them, against a live worker started with the default model (``shapes``, as
``make run``): the README's "Try it", and docs/clients.md's tour (which switches to ``tiny``, then
the Python that makes the example files). Every
file a page names under ``/tmp/`` must have been made by the page's own lines. The worker runs 4
steps where a request sets none (``--default-steps``; ``make run``'s is 20): what the examples
show does not depend on the count.

``/tmp/`` becomes a directory of the test's own and ``127.0.0.1:50051`` the worker's address; the
CLI finds the worker through ``DIFFUSION_TARGET``, as docs/clients.md says. The README's CLI lines
run in bash, calling ``.venv/bin/diffusion`` (the installed script) from a directory where that
path exists, as the repository root does; the other pages' lines run with the same arguments in
this process (``support.cli``), which spares an interpreter start per line. The Python blocks run
each as a process of its own, ``python -c`` as a reader runs them, forked from the runner's zygote
(``harness.forked_python``), which spares the imports of torch and diffusers the first blocks of
docs/clients.md and docs/conditioning.md make.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import CLI, PAGES, Block, blocks
from harness.forked_python import run_code
from harness.processes import REPO, start_worker
from support import CliResult, cli

pytestmark = pytest.mark.process

DOCS_TARGET = "127.0.0.1:50051"
# What a request that sets no steps runs (the module docstring).
DEFAULT_STEPS = ("--default-steps", "4")
README = REPO / "README.md"


@pytest.fixture(scope="module")
def worker(runner, tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("docs-logs"), runner.target, *DEFAULT_STEPS)
    yield worker
    worker.stop()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The docs' working directory (this process's too), with ``.venv/bin/diffusion`` where they call it."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / CLI.strip()).symlink_to(Path(sys.executable).parent / "diffusion")
    (tmp_path / "files").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def rewrite(code: str, worker, workdir: Path) -> str:
    return code.replace("/tmp/", f"{workdir}/files/").replace('"/tmp"', f'"{workdir}/files"').replace(
        DOCS_TARGET, worker.target)


def run_cli_line(line: str, in_bash: bool, worker) -> CliResult:
    if in_bash:
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "DIFFUSION_TARGET": worker.target})
        return CliResult(done.returncode, done.stdout, done.stderr)
    return cli(*shlex.split(line.removeprefix(CLI)), env={"DIFFUSION_TARGET": worker.target})


def run_cli_block(block: Block, worker, workdir: Path) -> None:
    """Each line, with the exit code the page says: 1 for ``health`` while asleep, an error naming
    the placeholder for ``cancel REQUEST_ID``, 0 otherwise."""
    asleep = False
    for line in block.lines:
        done = run_cli_line(rewrite(line, worker, workdir), block.page == README, worker)
        if line.endswith(" health") and asleep:
            assert done.returncode == 1, f"{line}: the page says exit 1 while asleep\n{done.stderr}"
        elif line.endswith(" cancel REQUEST_ID"):
            assert done.returncode != 0 and "REQUEST_ID" in done.stderr, f"{line}\n{done.stderr}"
        else:
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        asleep = (asleep or " sleep " in line) and " wake" not in line
        for output in re.findall(r" -o (\S+)", line):
            assert (workdir / output).stat().st_size > 0, line


def run_python_block(block: Block, worker, workdir: Path) -> None:
    done = run_code(rewrite(block.code, worker, workdir), workdir, timeout=300)
    assert done.returncode == 0, f"{block.code}\n{done.stdout}\n{done.stderr}"


WORKER_PAGES = [page for page in PAGES if any(block.kind in ("cli", "client") for block in blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", WORKER_PAGES, ids=lambda page: page.name)
def test_page_examples_run_as_written(page, worker, workdir):
    """Each page's CLI and client blocks, in order, in a working directory of their own."""
    ran = [block for block in blocks(page) if block.kind in ("cli", "client")]
    for block in ran:
        (run_cli_block if block.kind == "cli" else run_python_block)(block, worker, workdir)
    for name in re.findall(r"/tmp/([\w.-]+)", "".join(block.code for block in ran)):
        assert (workdir / "files" / name).stat().st_size > 0, f"{page.name} uses /tmp/{name}, which it never made"
