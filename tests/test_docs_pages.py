"""What the README, CONTRIBUTING.md and docs/ show, checked without services: every shell and Python
block has a test that runs it as written, every ``make`` line names a Makefile target, and
``make run ARGS=...`` passes its flags on as the README says."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from doc_blocks import GRPCURL, PAGES, blocks, of_kind
from harness.processes import REPO

pytestmark = pytest.mark.unit

CONTRIBUTING = REPO / "CONTRIBUTING.md"


def test_every_example_has_a_test_that_runs_it() -> None:
    unrun = [(block.page.name, block.code) for page in PAGES for block in blocks(page) if block.kind is None]
    assert not unrun, ("blocks no test runs (see tests/doc_blocks.py for what each test runs; grpcurl is "
                       f"not on PATH after make run, so write {GRPCURL.strip()}): {unrun}")


def test_the_readme_shows_the_cli_python_and_http() -> None:
    kinds = [block.kind for block in blocks(REPO / "README.md")]
    assert {"make", "cli", "client", "openai"} <= set(kinds), kinds
    assert len((REPO / "README.md").read_text().splitlines()) <= 150, "the README is a front page: 150 lines at most"


@pytest.mark.parametrize("target", sorted({
    line.split()[1] for block in of_kind("make", [*PAGES, CONTRIBUTING]) for line in block.lines}))
def test_make_lines_name_makefile_targets(target: str) -> None:
    # -n prints the recipes (install's too, when it is due) without running them.
    result = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_make_run_passes_args_to_the_pod_launcher() -> None:
    readme = (REPO / "README.md").read_text()
    documented_lines = re.findall(r'make run ARGS="([^"]+)"', readme)
    assert documented_lines
    for documented in documented_lines:
        result = subprocess.run(["make", "-n", "run", f"ARGS={documented}"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        [launch] = [line for line in result.stdout.splitlines() if "deploy/pod.py" in line]
        assert shlex.split(launch)[-len(shlex.split(documented)):] == shlex.split(documented)
