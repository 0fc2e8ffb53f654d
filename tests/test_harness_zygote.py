"""The harness's zygote (``harness/zygote.py``): a service the tests start is forked from a process
that has imported it, and is still a process of its own: it serves, ends on its own signal with its
own exit code, and writes its own log; a start whose environment the imports could have read
differently starts a fresh interpreter instead."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from harness.processes import start_runner, start_service
from harness.zygote import ForkedProcess, Zygote, _same_imports

pytestmark = pytest.mark.process


def test_a_runner_is_forked_serves_and_ends_with_its_own_signal_and_code(tmp_path):
    runner = start_runner(tmp_path)  # in pytest, whose PYTEST_CURRENT_TEST changes at every phase
    assert isinstance(runner.process, ForkedProcess)
    assert " serving on " in runner.log() and "found in sys.modules" not in runner.log()  # runpy's warning
    assert runner.stop() == 0 and "runner stopped" in runner.log()

    killed = start_runner(tmp_path)
    killed.process.kill()
    assert killed.process.wait(30) == -signal.SIGKILL


def test_a_refused_flag_exits_with_argparses_code_and_says_why_in_its_log(tmp_path):
    refused = start_service("runner", "runner_service.main", ["--no-such-flag"], tmp_path, "unused")
    assert isinstance(refused.process, ForkedProcess)
    assert refused.process.wait(60) == 2
    assert "unrecognized arguments: --no-such-flag" in refused.log()


def test_a_wait_past_its_timeout_raises_as_popens_does(tmp_path):
    runner = start_runner(tmp_path)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            runner.process.wait(0.01)
        assert runner.process.poll() is None
    finally:
        runner.stop()


def test_an_environment_read_at_import_starts_a_fresh_interpreter(tmp_path):
    worker = start_service("worker", "worker_service.main", ["--no-such-flag"], tmp_path, "unused",
                           env={"HF_HUB_OFFLINE": "1"})
    assert isinstance(worker.process, subprocess.Popen)
    assert worker.process.wait(60) == 2
    assert "unrecognized arguments: --no-such-flag" in worker.log()


def test_a_closed_zygote_leaves_no_directory_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tempfile's documented override
    zygote = Zygote(("json",), Path(__file__).parent.parent, dict(os.environ))
    assert zygote.usable and [path.name[:7] for path in tmp_path.iterdir()] == ["zygote-"]
    zygote.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("changed", "same"), [
    ({"TMPDIR": "/tmp/x"}, True),
    ({"DIFFUSION_MODEL_CACHE": "/tmp/m"}, True),
    ({"PYTEST_CURRENT_TEST": "t (call)"}, True),
    ({"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "140234"}, True),  # set by a compile in the test process
    ({"HF_HOME": "/tmp/h"}, False),
    ({"OMP_NUM_THREADS": "4"}, False),
])
def test_only_variables_read_at_run_time_may_differ(changed, same):
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert _same_imports(base, {**base, **changed}) is same
