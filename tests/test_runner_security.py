"""The runner accepts only callers with its shared token, and reads only under its model roots."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import runner_pb2
from harness.processes import health_status, start_runner
from runner_calls import info, runner_stub


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
