"""Tokens on the worker's public port (ops and inference), the runner token, TLS and mutual TLS,
and the message size check at start."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from certs import self_signed, wait_serving
from clients import DiffusionClient
from diffusion.v1 import worker_pb2
from harness.processes import REPO, free_port, health_status, start_service, worker_stub
from runner_service.main import parse_args as parse_runner_args
from worker_service.main import parse_args as parse_worker_args
from worker_service.security import token_policy

pytestmark = pytest.mark.process
W = worker_pb2
OPS, INFERENCE, RUNNER = "ops-s3cret", "inference-s3cret", "runner-s3cret"
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
REQUEST = W.GenerateRequest(prompt="a guarded fox", num_inference_steps=2, seed=9, output_format=W.OUTPUT_FORMAT_RAW)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("security")
    for name, token in (("ops", OPS), ("inference", INFERENCE), ("runner", RUNNER)):
        (base / f"{name}.token").write_text(token + "\n")
    return base


@pytest.fixture(scope="module")
def pair(serve, base):
    """A runner with a token, and a worker with ops and inference tokens: it reaches its runner only
    because it sends the runner token."""
    return serve("--ops-token-file", str(base / "ops.token"), "--inference-token-file", str(base / "inference.token"),
                 "--runner-token-file", str(base / "runner.token"),
                 runner_args=("--auth-token-file", str(base / "runner.token")))


@pytest.fixture(scope="module")
def stub(pair):
    """Not warmed, unlike the shared ``stub``: every call to this worker needs a token."""
    with worker_stub(pair.worker.target, warm=False) as stub:
        yield stub


def bearer(token):
    return [("authorization", f"Bearer {token}")] if token else None


def code_of(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "DESCRIPTOR"):
            list(result)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("token, expected", [(None, UNAUTHENTICATED), ("wrong", DENIED), (INFERENCE, DENIED)])
def test_ops_rpcs_need_the_ops_token(stub, token, expected):
    metadata = bearer(token)
    calls = {
        "Init": lambda: stub.Init(W.InitRequest(model="tiny"), metadata=metadata, timeout=10),
        "Sleep": lambda: stub.Sleep(W.SleepRequest(level=1), metadata=metadata, timeout=10),
        "WakeUp": lambda: stub.WakeUp(W.WakeUpRequest(), metadata=metadata, timeout=10),
        "LoadWeights": lambda: stub.LoadWeights(W.LoadWeightsRequest(path="/x"), metadata=metadata, timeout=10),
    }
    assert {name: code_of(call) for name, call in calls.items()} == dict.fromkeys(calls, expected)


def test_the_ops_token_gets_through(stub):
    assert stub.Sleep(W.SleepRequest(level=1), metadata=bearer(OPS), timeout=30).sleeping_components
    assert not stub.WakeUp(W.WakeUpRequest(), metadata=bearer(OPS), timeout=30).sleeping_components


@pytest.mark.parametrize("token, expected", [(None, UNAUTHENTICATED), ("wrong", DENIED)])
def test_inference_rpcs_need_a_token(stub, token, expected):
    metadata = bearer(token)
    assert code_of(lambda: stub.Generate(REQUEST, metadata=metadata, timeout=10)) == expected
    assert code_of(lambda: stub.GenerateStream(W.GenerateStreamRequest(request=REQUEST), metadata=metadata,
                                               timeout=10)) == expected
    assert code_of(lambda: stub.GetStatus(W.GetStatusRequest(), metadata=metadata, timeout=10)) == expected
    assert code_of(lambda: stub.Cancel(W.CancelRequest(request_id="x"), metadata=metadata, timeout=10)) == expected


def test_inference_and_ops_tokens_generate_through_the_runner_token(stub, pair):
    first = stub.Generate(REQUEST, metadata=bearer(INFERENCE), timeout=120).images[0].data
    assert stub.Generate(REQUEST, metadata=bearer(OPS), timeout=60).images[0].data == first
    assert stub.GetStatus(W.GetStatusRequest(), metadata=bearer(INFERENCE), timeout=10).state == W.WORKER_STATE_READY
    # Cancel gets past authentication with the inference token: the id is simply unknown.
    assert code_of(lambda: stub.Cancel(W.CancelRequest(request_id="nobody"), metadata=bearer(INFERENCE),
                                       timeout=10)) == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection_stay_open(pair):
    assert health_status(pair.worker.target, "diffusion.v1.WorkerService") == 1
    listed = subprocess.run([str(REPO / ".venv/bin/grpcurl"), "-plaintext", pair.worker.target, "list"],
                            capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0 and "diffusion.v1.WorkerService" in listed.stdout, listed.stderr


def test_client_library_sends_its_token(pair):
    with DiffusionClient(pair.worker.target, token=INFERENCE, timeout=30) as client:
        assert client.status().state == W.WORKER_STATE_READY
        with pytest.raises(grpc.RpcError) as refused:
            client.sleep(1)
        assert refused.value.code() == DENIED
    with DiffusionClient(pair.worker.target, token=OPS, timeout=30) as client:
        assert client.sleep(1).sleeping_components
        client.wake()


def test_token_policy_without_an_inference_token():
    ops_only = token_policy(OPS, None)
    method = "/diffusion.v1.WorkerService/{}".format
    assert ops_only(method("Generate")) is None and ops_only(method("GetStatus")) is None
    assert ops_only(method("Cancel")) == (OPS,)  # no client identity: cancelling needs the ops token
    assert ops_only(method("AttachRunner")) == ops_only(method("DetachRunner")) == (OPS,)
    inference_only = token_policy(None, INFERENCE)
    assert inference_only(method("Init")) == inference_only(method("Generate")) == (INFERENCE,)
    assert token_policy(None, None) is None
    both = token_policy(OPS, INFERENCE)
    assert set(both(method("Cancel"))) == {OPS, INFERENCE} and both(method("Sleep")) == (OPS,)


def start_tls_worker(base, runner, *args):
    target = f"127.0.0.1:{free_port()}"
    return start_service("worker", "worker_service.main",
                         ["--listen", target, "--runner", runner.target, "--runner-token-file",
                          str(base / "runner.token"), "--metrics-port", "0", "--http-port", "0", "--model", "",
                          *args], base, target)


def test_tls_round_trip(base, pair):
    cert, key = self_signed(base, "server")
    worker = start_tls_worker(base, pair.runner, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        wait_serving(worker, grpc.ssl_channel_credentials(cert.read_bytes()))
        with DiffusionClient(worker.target, tls_ca=cert, timeout=10) as client:
            assert client.status().runners[0].target == pair.runner.target
            assert client.health("") == "SERVING"
        with DiffusionClient(worker.target, timeout=5) as plaintext, pytest.raises(grpc.RpcError) as refused:
            plaintext.status()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        worker.stop()


def test_mutual_tls_needs_a_client_certificate(base, pair):
    cert, key = self_signed(base, "mtls-server")
    client_cert, client_key = self_signed(base, "client", common_name="ops-client")
    worker = start_tls_worker(base, pair.runner, "--tls-cert", str(cert), "--tls-key", str(key),
                              "--tls-client-ca", str(client_cert))
    try:
        wait_serving(worker, grpc.ssl_channel_credentials(cert.read_bytes(), client_key.read_bytes(),
                                                          client_cert.read_bytes()))
        with DiffusionClient(worker.target, tls_ca=cert, tls_cert=client_cert, tls_key=client_key,
                             timeout=10) as client:
            assert client.status().runners
        with DiffusionClient(worker.target, tls_ca=cert, timeout=5) as anonymous, \
                pytest.raises(grpc.RpcError) as refused:
            anonymous.status()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        cli = [sys.executable, "-m", "clients.cli", "--target", worker.target, "--tls-ca", str(cert), "--timeout", "10"]
        ok = subprocess.run([*cli, "--tls-cert", str(client_cert), "--tls-key", str(client_key), "status", "--json"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and '"runners"' in ok.stdout, ok.stderr
        assert subprocess.run([*cli, "status"], capture_output=True, timeout=60).returncode == 1
    finally:
        worker.stop()


def test_message_limit_below_the_largest_image_refuses_to_start(capsys):
    with pytest.raises(SystemExit):
        parse_worker_args(["--max-message-bytes", str(4 * 1024 * 1024)])
    assert "--max-message-bytes 4194304 is too small" in capsys.readouterr().err
    config, _, _ = parse_worker_args(["--max-message-bytes", str(4 * 1024 * 1024), "--max-size", "512"])
    assert config.max_message_bytes == 4 * 1024 * 1024
    with pytest.raises(SystemExit):
        parse_runner_args(["--max-message-bytes", "1000"])
    assert parse_runner_args(["--max-message-bytes", "2000000"]).max_message_bytes == 2000000
