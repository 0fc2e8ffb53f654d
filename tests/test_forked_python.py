"""harness.forked_python runs code as ``python -c`` does, in a process of its own, whether forked from
the runner's zygote or (``HARNESS_EXEC=1``) started fresh: the docs' tests pass a block only on its
exit code, so a failure must come back as one."""

from __future__ import annotations

import subprocess

import pytest

from harness.forked_python import run_code, run_module

pytestmark = pytest.mark.process

REPORT = "import os, sys\nprint(__name__, sys.argv, os.getcwd(), 'torch' in sys.modules)\n"


@pytest.fixture(params=["forked", "fresh"])
def start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fresh":
        monkeypatch.setenv("HARNESS_EXEC", "1")
    return str(request.param)


def test_code_runs_as_main_in_the_given_directory(start, tmp_path):
    done = run_code(REPORT + "open('made.txt', 'w').write('x')\n", tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    # Forked, the runner's imports are there already: what makes it cheap.
    assert done.stdout == f"__main__ ['-c'] {tmp_path} {start == 'forked'}\n"
    assert (tmp_path / "made.txt").read_text() == "x"


def test_a_failure_is_the_exit_code_with_the_traceback(start, tmp_path):
    raised = run_code("print('before')\nraise ValueError('the block failed')\n", tmp_path, timeout=60)
    assert raised.returncode == 1 and raised.stdout == "before\n"
    assert "ValueError: the block failed" in raised.stderr and "Traceback" in raised.stderr
    assert run_code("raise SystemExit(3)", tmp_path, timeout=60).returncode == 3
    said = run_code("raise SystemExit('bad request')", tmp_path, timeout=60)
    assert (said.returncode, said.stderr) == (1, "bad request\n")


def test_a_module_runs_with_its_arguments(start, tmp_path):
    done = run_module("runner_service.models.build", ["no-such-model", str(tmp_path / "out")], tmp_path, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'no-such-model'" in done.stderr, done.stderr


def test_a_run_past_its_timeout_is_killed(start, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_code("import threading\nthreading.Event().wait()\n", tmp_path, timeout=1)
