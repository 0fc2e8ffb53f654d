"""Temporary directories are removed at the next start when the process that owned them was killed
(SIGKILL: no cleanup ran), and never while it lives: the worker's push directory and the pod's
token directory (tests/test_clients.py) both rely on it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from harness.processes import start_fake_runner, start_worker, wait_until
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


def test_a_live_owners_directory_stays_and_a_killed_workers_push_directory_goes(tmp_path: Path) -> None:
    mine = owned_temporary_directory(PUSH_DIR_PREFIX)
    runner = start_fake_runner(tmp_path)
    try:
        killed = start_worker(tmp_path, runner.target)
        [left] = wait_until(lambda: owned_by(killed.pid, PUSH_DIR_PREFIX), 30, "the worker's push directory")
        killed.stop(signal.SIGKILL)  # no cleanup can run
        assert left.is_dir()
        removed: list[Path] = []
        remove_abandoned(PUSH_DIR_PREFIX, removed.append)
        assert left in removed and not left.exists()
        assert mine.is_dir() and mine not in removed  # this process still owns it
        # A worker's own start does the same for the next one killed.
        again = start_worker(tmp_path, runner.target)
        [second] = owned_by(again.pid, PUSH_DIR_PREFIX)
        again.stop(signal.SIGKILL)
        assert second.is_dir()
        third = start_worker(tmp_path, runner.target)
        try:
            assert not second.exists()
            assert third.log().count("left by a worker that was killed") >= 1
        finally:
            third.stop()
    finally:
        runner.stop()
