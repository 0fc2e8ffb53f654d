"""The worker and its runner's lifetime: a runner that starts late, and one that restarts (fake runner
processes: the re-apply is the worker's; test_faults kills a real runner)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import free_port, health_status, start_fake_runner, start_worker
from support import request

pytestmark = pytest.mark.process
W = worker_pb2
READY = "diffusion.v1.WorkerService"
REQUEST = request(prompt="a harbour", seed=5)


def test_worker_before_runner_then_runner_restart(tmp_path):
    target = f"127.0.0.1:{free_port()}"
    worker = start_worker(tmp_path, target, ready=False)
    runner = None
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
            assert status.state == W.WORKER_STATE_STARTING and not status.runners[0].connected
            assert health_status(worker.target, READY) == health_pb2.HealthCheckResponse.NOT_SERVING
            with_no_runner = grpc.StatusCode.UNAVAILABLE
            try:
                stub.Generate(REQUEST, timeout=10)
                raise AssertionError("Generate succeeded without a runner")
            except grpc.RpcError as error:
                assert error.code() == with_no_runner

            runner = start_fake_runner(tmp_path, target=target)
            worker.wait_healthy(READY, timeout=60)
            baseline = stub.Generate(REQUEST, timeout=60).images[0].data

            path = tmp_path / "perturbed.safetensors"
            path.write_bytes(b"weights")  # the fake runner reads no tensors
            version = stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=60).weights_version
            perturbed = stub.Generate(REQUEST, timeout=60).images[0].data
            assert perturbed != baseline
            stub.Sleep(W.SleepRequest(level=1), timeout=30)
            instance = stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].info.instance_id

            runner.stop()
            deadline = time.monotonic() + 10
            while stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].connected:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            runner = start_fake_runner(tmp_path, target=target)
            deadline = time.monotonic() + 60
            while True:
                status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
                if status.runners[0].info.instance_id not in ("", instance) and status.state in (
                        W.WORKER_STATE_SLEEPING, W.WORKER_STATE_FAILED):
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            # Re-applied: the model, the loaded weights, then the sleep.
            assert status.state == W.WORKER_STATE_SLEEPING, status.message
            assert set(status.sleeping_components) == {"unet", "vae", "text_encoder"}
            assert status.weights_version == version
            stub.WakeUp(W.WakeUpRequest(), timeout=30)
            assert stub.Generate(REQUEST, timeout=60).images[0].data == perturbed
    finally:
        worker.stop()
        if runner is not None:
            runner.stop()


def test_level_2_sleep_drops_weight_updates_for_restarted_runners_too(tmp_path):
    target = f"127.0.0.1:{free_port()}"
    runner = start_fake_runner(tmp_path, target=target)
    worker = start_worker(tmp_path, target)
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            baseline = stub.Generate(REQUEST, timeout=60).images[0].data
            path = tmp_path / "perturbed.safetensors"
            path.write_bytes(b"weights")  # the fake runner reads no tensors
            stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=60)
            stub.Sleep(W.SleepRequest(level=2), timeout=30)
            stub.WakeUp(W.WakeUpRequest(), timeout=30)
            assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline  # reloaded from the source
            instance = stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].info.instance_id

            runner.stop(signal.SIGKILL)
            runner = start_fake_runner(tmp_path, target=target)
            deadline = time.monotonic() + 60
            while True:
                status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
                if status.runners[0].info.instance_id not in ("", instance) and status.state == W.WORKER_STATE_READY:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline
    finally:
        worker.stop()
        runner.stop()
