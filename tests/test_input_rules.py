"""Caller strings and deadlines against a real worker and runner (issue 20, items 7 and 8).

Every string that becomes a path, a name or a log line refuses NUL and control characters with
INVALID_ARGUMENT naming its field, on the worker and on the runner alike (one rule,
``serving_common.input_rules``). A deadline beyond what gRPC carries is clamped, so it neither
fails at once nor crashes: ``X-Request-Timeout: 8e9`` over HTTP, ``grpcurl -max-time 8e9`` over gRPC.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request

import grpc
import pytest

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from harness.processes import REPO
from runner_calls import item, runner_stub
from serving_common.errors import field_violations

W, R = worker_pb2, runner_pb2
GRPCURL = REPO / ".venv" / "bin" / "grpcurl"
# Past 2262 in nanoseconds since the epoch: gRPC Python's own deadline wraps around for this.
HUGE_TIMEOUT = "8e9"
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def pair(serve, runner):
    return serve(on=runner, http=True)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


WORKER_CALLS = {
    "model": lambda s: s.Init(W.InitRequest(model="tiny\x00x"), timeout=30),
    "path": lambda s: s.LoadWeights(W.LoadWeightsRequest(path="/tmp/weights\x00.safetensors"), timeout=30),
    "name": lambda s: s.UnloadAdapter(W.UnloadAdapterRequest(name="style\n"), timeout=30),
    "target": lambda s: s.AttachRunner(W.AttachRunnerRequest(target="127.0.0.1:1\x00"), timeout=30),
    "request_id": lambda s: s.Cancel(W.CancelRequest(request_id="forged\nline"), timeout=30),
    "tags[1]": lambda s: s.Sleep(W.SleepRequest(level=1, tags=["unet", "vae\x1b[2J"]), timeout=30),
    "request.request_id": lambda s: next(iter(s.GenerateStream(W.GenerateStreamRequest(
        request=W.GenerateRequest(request_id="a\x00b", num_inference_steps=1)), timeout=30))),
}


@pytest.mark.parametrize("field", WORKER_CALLS)
def test_a_control_character_in_a_worker_string_is_refused_naming_its_field(stub, pair, field):
    refused = refusal(lambda: WORKER_CALLS[field](stub))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert field in field_violations(refused) and len(refused.details()) < 400
    status = stub.GetStatus(W.GetStatusRequest(), timeout=10)
    assert status.state == W.WORKER_STATE_READY and status.model.source == "tiny"
    assert "failed unexpectedly" not in pair.worker.log()


def test_load_adapter_names_both_bad_fields(stub):
    refused = refusal(lambda: stub.LoadAdapter(W.LoadAdapterRequest(name="style.v2", path="/tmp/a\x00"), timeout=30))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(field_violations(refused)) == {"name", "path"}


RUNNER_CALLS = {
    "source": lambda r: r.LoadModel(R.LoadModelRequest(source="tiny\x00x"), timeout=30),
    "path": lambda r: r.LoadWeights(R.RunnerServiceLoadWeightsRequest(path="/tmp/w\x00"), timeout=30),
    "name": lambda r: r.UnloadAdapter(R.RunnerServiceUnloadAdapterRequest(name="a\x00"), timeout=30),
    "items[0].request_id": lambda r: list(r.Execute(R.ExecuteRequest(items=[item(request_id="a\r\nb")]), timeout=30)),
    "items[0].adapters[0].name": lambda r: list(r.Execute(R.ExecuteRequest(items=[
        item(adapters=[common_pb2.AdapterRef(name="a.b")])]), timeout=30)),
    "items[0].adapters[0].scale": lambda r: list(r.Execute(R.ExecuteRequest(items=[
        item(adapters=[common_pb2.AdapterRef(name="a", scale=1e30)])]), timeout=30)),
}


@pytest.mark.parametrize("field", RUNNER_CALLS)
def test_the_runner_refuses_them_too(stub, runner, field):
    """Called directly (the worker refuses them first), the runner answers INVALID_ARGUMENT, not INTERNAL."""
    refused = refusal(lambda: RUNNER_CALLS[field](runner_stub(runner.target)))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert field in field_violations(refused)
    assert stub.GetStatus(W.GetStatusRequest(), timeout=10).model.source == "tiny"
    assert "failed unexpectedly" not in runner.log()


def test_a_huge_x_request_timeout_is_carried_not_expired_at_once(stub, pair):
    body = json.dumps({"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{pair.http_port}/v1/images/generations", data=body,
                                     headers={"Content-Type": "application/json", "X-Request-Timeout": HUGE_TIMEOUT})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert base64.b64decode(json.loads(response.read())["data"][0]["b64_json"]).startswith(b"\x89PNG")


def test_a_huge_grpc_timeout_is_carried_not_expired_at_once(stub, pair):
    """gRPC Python cannot send such a timeout (its own deadline wraps); grpcurl (Go) sends it as is."""
    request = json.dumps({"prompt": "a red fox", "width": 64, "height": 64, "numInferenceSteps": 1})
    done = subprocess.run([str(GRPCURL), "-plaintext", "-max-time", HUGE_TIMEOUT, "-d", request, pair.worker.target,
                           "diffusion.v1.WorkerService/Generate"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(json.loads(done.stdout)["images"]) == 1
