"""The runner accepts only callers with its shared token, and reads only under its model roots."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import runner_pb2
from harness.processes import health_status, start_runner
from runner_calls import info, perturbed_weights, refused, runner_stub, tiny_model_copy

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    base = tmp_path_factory.mktemp("guarded")
    (base / "token").write_text("s3cret\n")
    (base / "models").mkdir()
    runner = start_runner(base, "--auth-token-file", str(base / "token"), "--model-root", str(base / "models"))
    yield runner, base
    runner.stop()


def call(target: str, token: str | None, request):
    metadata = [("authorization", f"Bearer {token}")] if token else None
    return runner_stub(target).LoadWeights(request, metadata=metadata)


@pytest.mark.parametrize("token, code", [(None, grpc.StatusCode.UNAUTHENTICATED),
                                         ("wrong", grpc.StatusCode.PERMISSION_DENIED)])
def test_calls_without_the_shared_token_are_refused(guarded, token, code):
    runner, _ = guarded
    with pytest.raises(grpc.RpcError) as error:
        call(runner.target, token, runner_pb2.RunnerServiceLoadWeightsRequest(path="/x"))
    assert error.value.code() == code
    with pytest.raises(grpc.RpcError) as streaming:
        list(runner_stub(runner.target).Execute(runner_pb2.ExecuteRequest()))
    assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_for_probes(guarded):
    runner, _ = guarded
    assert health_status(runner.target, "diffusion.v1.RunnerService") == 1


def test_paths_outside_the_model_roots_are_permission_denied(guarded, tmp_path):
    runner, base = guarded
    outside = tmp_path / "weights.safetensors"
    outside.write_bytes(b"not read")
    for path in (str(outside), str(base / "models" / ".." / "token")):
        with pytest.raises(grpc.RpcError) as error:
            call(runner.target, "s3cret", runner_pb2.RunnerServiceLoadWeightsRequest(path=path))
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "model roots" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        runner_stub(runner.target).LoadModel(runner_pb2.LoadModelRequest(source=str(tmp_path)),
                                            metadata=[("authorization", "Bearer s3cret")])
    assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_right_token_gets_through(guarded):
    runner, _ = guarded
    described = runner_stub(runner.target).GetInfo(runner_pb2.GetInfoRequest(),
                                                   metadata=[("authorization", "Bearer s3cret")])
    assert described.info.platform == "cpu"
    with pytest.raises(grpc.RpcError):
        info(runner_stub(runner.target))


AUTH = [("authorization", "Bearer s3cret")]


@pytest.fixture(scope="module")
def confined(guarded):
    """The guarded runner with a copy of tiny loaded from inside its root, and a directory outside it."""
    runner, base = guarded
    stub = runner_stub(runner.target)
    tiny_model_copy(base / "models" / "tiny")
    stub.LoadModel(runner_pb2.LoadModelRequest(source=str(base / "models" / "tiny")), metadata=AUTH, timeout=60)
    outside = base / "outside"
    outside.mkdir()
    perturbed_weights(outside / "real.safetensors")
    return stub, base, outside


def test_a_weights_file_linking_out_of_the_roots_is_refused_and_changes_nothing(confined):
    stub, base, outside = confined
    version = stub.GetInfo(runner_pb2.GetInfoRequest(), metadata=AUTH).info.weights_version
    weights = base / "models" / "weights"
    weights.mkdir()
    (weights / "a.safetensors").symlink_to(outside / "real.safetensors")
    for path in (weights, weights / "a.safetensors"):
        error = refused(stub.LoadWeights, runner_pb2.RunnerServiceLoadWeightsRequest(path=str(path)), metadata=AUTH)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "model roots" in error.details()
    assert stub.GetInfo(runner_pb2.GetInfoRequest(), metadata=AUTH).info.weights_version == version


def test_a_model_folder_linking_out_of_the_roots_is_refused_and_the_model_stays(confined):
    stub, base, outside = confined
    before = stub.GetInfo(runner_pb2.GetInfoRequest(), metadata=AUTH).info
    escaping = tiny_model_copy(base / "models" / "escaping")
    (escaping / "unet").rename(outside / "unet")
    (escaping / "unet").symlink_to(outside / "unet")
    error = refused(stub.LoadModel, runner_pb2.LoadModelRequest(source=str(escaping)), metadata=AUTH)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "unet" in error.details()
    after = stub.GetInfo(runner_pb2.GetInfoRequest(), metadata=AUTH).info
    assert after.model == before.model and after.instance_id == before.instance_id
    # Links that stay inside the roots are fine.
    inside = base / "models" / "shared-unet"
    (outside / "unet").rename(inside)
    (escaping / "unet").unlink()
    (escaping / "unet").symlink_to(inside)
    loaded = stub.LoadModel(runner_pb2.LoadModelRequest(source=str(escaping)), metadata=AUTH, timeout=60)
    assert loaded.info.model.source == str(escaping)
