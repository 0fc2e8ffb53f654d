"""Sleep, WakeUp, --auto-wake, LoadWeights and Init through the worker: its policy against the fake
runner process, and one smoke test of each on a real runner."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from safetensors.numpy import save_file

from diffusion.v1 import worker_pb2
from harness.processes import health_status, start_worker, worker_stub
from runner_calls import perturbed_weights
from serving_common.errors import field_violations
from support import REQUEST, request

pytestmark = pytest.mark.process
W = worker_pb2
READY = "diffusion.v1.WorkerService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def pair(serve):
    return serve(fake_step_s=0.0)


@pytest.fixture(scope="module")
def baseline(stub) -> bytes:
    return stub.Generate(REQUEST, timeout=60).images[0].data


def expect_error(call, code):
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    return caught.value


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_blocks_generation_and_wake_restores_identical_output(pair, stub, baseline, level):
    worker = pair.worker
    slept = stub.Sleep(W.SleepRequest(level=level), timeout=30)
    assert set(slept.sleeping_components) == {"unet", "vae", "text_encoder"}
    assert slept.weight_bytes_released > 0
    assert health_status(worker.target, READY) == NOT_SERVING
    assert health_status(worker.target, "") == SERVING
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_SLEEPING and status.sleep_level == level
    error = expect_error(lambda: stub.Generate(REQUEST, timeout=30), grpc.StatusCode.FAILED_PRECONDITION)
    assert "WakeUp" in error.details()
    assert stub.Sleep(W.SleepRequest(level=level), timeout=30).sleeping_components  # idempotent
    woke = stub.WakeUp(W.WakeUpRequest(), timeout=30)
    assert list(woke.sleeping_components) == []
    assert health_status(worker.target, READY) == SERVING
    assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline
    assert list(stub.WakeUp(W.WakeUpRequest(), timeout=30).sleeping_components) == []  # idempotent


def test_partial_wake_stays_sleeping(pair, stub, baseline):
    stub.Sleep(W.SleepRequest(level=1), timeout=30)
    woke = stub.WakeUp(W.WakeUpRequest(tags=["unet"]), timeout=30)
    assert set(woke.sleeping_components) == {"vae", "text_encoder"}
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_SLEEPING
    assert set(status.sleeping_components) == {"vae", "text_encoder"}
    assert health_status(pair.worker.target, READY) == NOT_SERVING
    stub.WakeUp(W.WakeUpRequest(), timeout=30)
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline


def test_bad_sleep_level_and_unknown_tags(stub):
    error = expect_error(lambda: stub.Sleep(W.SleepRequest(level=3), timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "level" in field_violations(error)
    expect_error(lambda: stub.WakeUp(W.WakeUpRequest(tags=["nope"]), timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY


def test_empty_fields_of_lifecycle_rpcs(stub):
    error = expect_error(lambda: stub.Init(W.InitRequest(), timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert "model" in field_violations(error)
    error = expect_error(lambda: stub.LoadWeights(W.LoadWeightsRequest(), timeout=10),
                         grpc.StatusCode.INVALID_ARGUMENT)
    assert "path" in field_violations(error)


def test_load_weights_changes_output_and_init_restores(stub, baseline, tmp_path):
    before = stub.GetStatus(W.GetStatusRequest(), timeout=5).weights_version
    path = tmp_path / "perturbed.safetensors"
    path.write_bytes(b"weights")  # the fake runner reads no tensors
    loaded = stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=60)
    assert list(loaded.loaded_names) == ["unet.conv_in.weight"]
    assert loaded.weights_version and loaded.weights_version != before
    response = stub.Generate(REQUEST, timeout=60)
    assert response.images[0].data != baseline
    assert response.weights_version == loaded.weights_version
    assert stub.GetStatus(W.GetStatusRequest(), timeout=5).weights_version == loaded.weights_version

    init = stub.Init(W.InitRequest(model="tiny"), timeout=60)
    assert init.model.source == "tiny"
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline


def test_failed_init_keeps_serving_the_model_it_had(pair, stub, baseline):
    expect_error(lambda: stub.Init(W.InitRequest(model="/no/such/model"), timeout=60), grpc.StatusCode.INVALID_ARGUMENT)
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_READY and status.model.source == "tiny"
    assert health_status(pair.worker.target, READY) == SERVING
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline
    stub.Init(W.InitRequest(model="tiny"), timeout=60)
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline


def test_auto_wake_wakes_on_generate(fake_pair):
    with worker_stub(fake_pair("--auto-wake").worker.target) as stub:
        before = stub.Generate(REQUEST, timeout=60).images[0].data
        stub.Sleep(W.SleepRequest(level=2), timeout=30)
        assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_SLEEPING
        assert stub.Generate(REQUEST, timeout=60).images[0].data == before
        assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY


@pytest.mark.slow
def test_sleep_weights_and_init_on_a_real_runner(real_runner, tmp_path):
    """The smoke test on a real runner: a level-2 sleep and a wake give the same image, loaded
    weights change it (a file with tensors the model lacks is refused), Init restores it and leaves
    tiny loaded, awake."""
    worker = start_worker(tmp_path, real_runner.target, "--model", "tiny")
    quick = request(num_inference_steps=2)
    try:
        with worker_stub(worker.target) as stub:
            baseline = stub.Generate(quick, timeout=60).images[0].data
            assert stub.Sleep(W.SleepRequest(level=2), timeout=30).weight_bytes_released > 0
            stub.WakeUp(W.WakeUpRequest(), timeout=60)
            assert stub.Generate(quick, timeout=60).images[0].data == baseline

            path = tmp_path / "perturbed.safetensors"
            perturbed_weights(path)
            loaded = stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=60)
            assert list(loaded.loaded_names) == ["unet.conv_in.weight"]
            assert stub.Generate(quick, timeout=60).images[0].data != baseline
            bad = tmp_path / "unknown.safetensors"
            save_file({"unet.no_such_tensor": np.zeros(3, dtype=np.float32)}, str(bad))
            expect_error(lambda: stub.LoadWeights(W.LoadWeightsRequest(path=str(bad)), timeout=30),
                         grpc.StatusCode.INVALID_ARGUMENT)
            stub.Init(W.InitRequest(model="tiny"), timeout=60)
            assert stub.Generate(quick, timeout=60).images[0].data == baseline
    finally:
        worker.stop()
