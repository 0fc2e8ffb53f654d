"""Temporary directories are removed at the next start when the process that owned them was killed
(SIGKILL: no cleanup ran), and never while it lives: the worker's push directory, the runner's spill
directory (tests/test_runner_hardening.py) and the pod's token directory (tests/test_clients.py)
all rely on it."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from diffusion.v1 import runner_pb2
from harness.forked_python import run_module
from harness.processes import start_fake_runner, start_runner, start_worker, wait_until
from runner_calls import runner_stub
from serving_common.owned_dirs import owned_temporary_directory, remove_abandoned
from worker_service.weight_push import PUSH_DIR_PREFIX

pytestmark = pytest.mark.process


def owned_by(pid: int, prefix: str) -> list[Path]:
    """The directories named ``prefix...`` that process ``pid`` holds open (its lock)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.name.startswith(prefix):
            found.append(target)
    return found


def test_a_live_owners_directory_stays_and_a_killed_workers_push_directory_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A temporary directory of the test's own, for this process (tempfile.tempdir, which tempfile
    # documents for this) and its workers (TMPDIR): any worker starting elsewhere in the suite removes
    # abandoned push directories from the shared one, which would take this test's from under it.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    env = {"TMPDIR": str(temporary)}
    mine = owned_temporary_directory(PUSH_DIR_PREFIX)
    runner = start_fake_runner(tmp_path)
    try:
        killed = start_worker(tmp_path, runner.target, env=env)
        [left] = wait_until(lambda: owned_by(killed.pid, PUSH_DIR_PREFIX), 30, "the worker's push directory")
        killed.stop(signal.SIGKILL)  # no cleanup can run
        assert left.is_dir()
        removed: list[Path] = []
        remove_abandoned(PUSH_DIR_PREFIX, removed.append)
        assert left in removed and not left.exists()
        assert mine.is_dir() and mine not in removed  # this process still owns it
        # A worker's own start does the same for the next one killed.
        again = start_worker(tmp_path, runner.target, env=env)
        [second] = owned_by(again.pid, PUSH_DIR_PREFIX)
        again.stop(signal.SIGKILL)
        assert second.is_dir()
        third = start_worker(tmp_path, runner.target, env=env)
        try:
            assert not second.exists()
            assert third.log().count("left by a worker that was killed") >= 1
        finally:
            third.stop()
    finally:
        runner.stop()


def test_a_runner_spills_into_a_directory_of_its_own_and_a_killed_ones_goes_at_the_next_start(tmp_path: Path) -> None:
    """The spill directory is made at the first sleep (level 1 on CPU), removed at SIGTERM, and
    removed by the next runner's start after a SIGKILL."""
    from runner_service.platforms.offload import SPILL_PREFIX  # torch: only in the runner tests

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}

    def spilled_by():
        runner = start_runner(tmp_path, "--model", "tiny", env=env)
        assert not owned_by(runner.pid, SPILL_PREFIX), "made before the first sleep"
        runner_stub(runner.target).Sleep(runner_pb2.RunnerServiceSleepRequest(level=1), timeout=60)
        [directory] = owned_by(runner.pid, SPILL_PREFIX)
        assert directory.parent == temporary and any(directory.glob("*.safetensors"))
        return runner, directory

    killed, left = spilled_by()
    killed.stop(signal.SIGKILL)  # no cleanup can run
    assert left.is_dir()
    stopped, directory = spilled_by()
    assert not left.exists() and "left by a runner that was killed" in stopped.log()
    stopped.stop()
    assert not directory.exists()


def test_a_runner_that_cannot_bind_leaves_no_spill_directory(tmp_path: Path) -> None:
    from runner_service.platforms.offload import SPILL_PREFIX  # torch: only in this test

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # Forked from the runner's zygote: the test is of the runner's start, not of its imports.
        done = run_module("runner_service.main", ["--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--device", "cpu"],
                          env={"TMPDIR": str(temporary)}, timeout=120)
    assert done.returncode != 0 and "--listen" in done.stderr, done.stderr
    assert not [path for path in temporary.iterdir() if SPILL_PREFIX in path.name]  # torch leaves its own
