"""The clients' typed errors against a real worker on the fake runner process (the errors are the
worker's and the client's; PushResult is checked in test_clients_adapters_push, on a real runner).

One worker with tokens (so UNAUTHENTICATED and PERMISSION_DENIED can happen) and room for one queued
request (so RESOURCE_EXHAUSTED can): every status a caller handles arrives as its own class, is still
a ``grpc.RpcError``, and carries what the server sent (field violations, the retry hint).
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import grpc
import pytest

from clients import (
    AsyncDiffusionClient,
    Cancelled,
    DeadlineExceeded,
    DiffusionClient,
    DiffusionError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Progress,
    Queued,
    ResourceExhausted,
    Started,
    Unauthenticated,
    Unavailable,
)
from clients.errors import from_rpc_error
from harness.processes import free_port
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES
from serving_common.errors import field_violations
from support import cli

pytestmark = [pytest.mark.timeout(180), pytest.mark.process]
OPS_TOKEN, INFERENCE_TOKEN = "ops-secret", "inference-secret"
LONG_STEPS = 500


@pytest.fixture(scope="module")
def pair(serve, tmp_path_factory):
    """Tokens configured; one request runs, one may wait, the next is refused."""
    tokens = tmp_path_factory.mktemp("tokens")
    (tokens / "ops").write_text(OPS_TOKEN)
    (tokens / "inference").write_text(INFERENCE_TOKEN)
    return serve("--ops-token-file", str(tokens / "ops"), "--inference-token-file", str(tokens / "inference"),
                 "--max-queue", "1", "--max-batch-size", "1", fake_step_s=0.01)


@pytest.fixture(scope="module")
def client(pair):
    with DiffusionClient(pair.worker.target, timeout=60, token=OPS_TOKEN) as client:
        yield client


def until(stream, kind):
    """The stream's events up to and including the first of type ``kind``."""
    for event in stream:
        if isinstance(event, kind):
            return event
    raise AssertionError(f"the stream ended before a {kind.__name__}")


def test_invalid_argument_carries_its_field_violations_and_is_still_an_rpc_error(client):
    with pytest.raises(InvalidArgument) as caught:
        client.generate("a fox", width=65, height=13)
    error = caught.value
    assert set(error.violations) == {"width", "height"} and "65" in error.violations["width"]
    # What catching grpc.RpcError gave before still works.
    assert isinstance(error, grpc.RpcError) and isinstance(error, DiffusionError)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == error.message
    assert field_violations(error) == error.violations
    assert str(error).startswith("INVALID_ARGUMENT: ")


def test_async_calls_and_streams_raise_the_same_types(pair):
    async def scenario():
        async with AsyncDiffusionClient(pair.worker.target, timeout=60, token=OPS_TOKEN) as aio:
            with pytest.raises(InvalidArgument) as unary:
                await aio.generate("a fox", width=65)
            with pytest.raises(InvalidArgument) as streamed:
                async for _ in aio.stream("a fox", width=65):
                    pass
            with pytest.raises(NotFound):
                await aio.cancel("no-such-request")
            return unary.value, streamed.value

    unary, streamed = asyncio.run(scenario())
    assert "width" in unary.violations and "request.width" in streamed.violations  # the stream wraps the request


def test_a_full_queue_is_resource_exhausted_with_the_servers_retry_hint(client, pair):
    with DiffusionClient(pair.worker.target, timeout=60, token=OPS_TOKEN) as other, contextlib.ExitStack() as streams:
        running = client.stream("a fox", steps=LONG_STEPS, request_id="errors-running")
        streams.callback(running.cancel)
        until(running, Progress)  # running, out of the queue, before the next is sent (else the queue holds it)
        waiting = other.stream("a fox", steps=LONG_STEPS, request_id="errors-waiting")
        streams.callback(waiting.cancel)
        assert until(waiting, Queued).position == 0
        with pytest.raises(ResourceExhausted) as caught:
            client.generate("a fox", steps=2)
        assert caught.value.retry_after == 1.0 and "queue is full" in caught.value.message
        # A cancelled stream raises Cancelled while it is iterated.
        assert client.cancel("errors-waiting") == "queued"
        with pytest.raises(Cancelled):
            until(waiting, Started)


def test_a_refusal_a_retry_cannot_fix_has_no_retry_hint(client):
    # RESOURCE_EXHAUSTED from gRPC itself: the request is over the 64 MiB message size limit.
    with pytest.raises(ResourceExhausted) as caught:
        client.generate("a fox", image=bytes(DEFAULT_MAX_MESSAGE_BYTES + 1))
    assert caught.value.retry_after is None


def test_unknown_request_is_not_found(client):
    with pytest.raises(NotFound):
        client.cancel("no-such-request")


def test_a_sleeping_model_is_failed_precondition(client):
    client.sleep(1)
    try:
        with pytest.raises(FailedPrecondition) as caught:
            client.generate("a fox", steps=1)
        assert "asleep" in caught.value.message
    finally:
        client.wake()


def test_no_worker_is_unavailable():
    with DiffusionClient(f"127.0.0.1:{free_port()}", timeout=10) as nobody:
        with pytest.raises(Unavailable):
            nobody.status()


def test_a_passed_deadline_is_deadline_exceeded(client):
    # A service that never becomes SERVING: the deadline passes, whatever the machine's speed.
    with pytest.raises(DeadlineExceeded):
        client.wait_ready("no.such.Service", timeout=0.5)


def test_tokens_are_unauthenticated_and_permission_denied(pair):
    with DiffusionClient(pair.worker.target, timeout=30) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.status()
    with DiffusionClient(pair.worker.target, timeout=30, token=INFERENCE_TOKEN) as inference:
        assert inference.status().model.source == "tiny"
        with pytest.raises(PermissionDenied):
            inference.sleep(1)


def test_a_status_without_a_class_of_its_own_is_the_base_class(pair):
    # The worker does not implement the runner's service: UNIMPLEMENTED, a plain DiffusionError.
    with grpc.insecure_channel(pair.worker.target) as channel:
        call = channel.unary_unary("/diffusion.v1.RunnerService/GetInfo")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", timeout=30, metadata=(("authorization", f"Bearer {OPS_TOKEN}"),))
    error = from_rpc_error(caught.value)
    assert type(error) is DiffusionError and error.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("timeout", [1e10, math.inf])
def test_a_timeout_beyond_what_grpc_carries_waits_instead_of_expiring_at_once(pair, timeout):
    """gRPC Python's deadline in int64 nanoseconds wraps past about 7.4e9 s from now: clamped as the
    worker clamps what it carries on, the call runs."""
    with DiffusionClient(pair.worker.target, timeout=timeout, token=OPS_TOKEN) as patient:
        assert patient.generate("a fox", steps=2).images
        assert patient.status(timeout=timeout).model.source == "tiny"

    async def scenario():
        async with AsyncDiffusionClient(pair.worker.target, token=OPS_TOKEN) as aio:
            return await aio.generate("a fox", steps=2, timeout=timeout)

    assert asyncio.run(scenario()).images
    done = cli("--target", pair.worker.target, "--token", OPS_TOKEN, "--timeout", str(timeout), "status")
    assert done.returncode == 0


@pytest.mark.parametrize("timeout", [math.nan, -1.0])
def test_a_timeout_that_is_no_duration_is_refused_naming_it(pair, timeout):
    with pytest.raises(ValueError, match="timeout"):
        DiffusionClient(pair.worker.target, timeout=timeout)
    with DiffusionClient(pair.worker.target, token=OPS_TOKEN) as client, pytest.raises(ValueError, match="timeout"):
        client.status(timeout=timeout)
    refused = cli("--target", pair.worker.target, "--token", OPS_TOKEN, "--timeout", str(timeout), "status")
    assert refused.returncode == 2 and "--timeout" in refused.stderr, refused
