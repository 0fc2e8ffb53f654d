"""Worker and runner on unix sockets, as in the Kubernetes pod (a shared emptyDir)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from clients import DiffusionClient
from harness.processes import start_runner, start_worker

pytestmark = pytest.mark.process


def test_generate_over_unix_sockets_end_to_end():
    # Socket paths must stay short (about 100 bytes), so not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="sock-") as directory:
        runner_target, worker_target = f"unix:{directory}/runner.sock", f"unix:{directory}/worker.sock"
        runner = start_runner(Path(directory), target=runner_target)
        worker = start_worker(Path(directory), runner_target, "--model", "tiny", target=worker_target)
        try:
            with DiffusionClient(worker_target) as client:
                result = client.generate("a lantern", steps=1, seed=3, timeout=120)
                assert result.images[0].to_pil().size == (64, 64)
                status = client.status()
                assert status.runners[0].target == runner_target and status.runners[0].connected
        finally:
            assert worker.stop() == 0
            assert runner.stop() == 0
