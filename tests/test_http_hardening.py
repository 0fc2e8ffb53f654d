"""The HTTP port under attack (issue 20 item 2), against a real worker on the fake runner process.

The attacks are ``benchmarks/attacks_http``'s, kept up (closed connections reopened) while each
test checks that the worker's guards act: connections past ``--http-max-connections`` are
answered 503, a request's headers or body that do not arrive in time have their connection
closed, bodies past ``--http-max-body-bytes-in-flight`` are refused 429, and meanwhile gRPC
health and Generate answer. Every wait is for an event (a count of what the server did to the
attack's connections), never for a time.
"""

from __future__ import annotations

import json
import os
import resource
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.attacks_http import partial_bodies, slowloris
from diffusion.v1 import worker_pb2
from worker_service.http.body import MAX_BODY_BYTES
from worker_service.http.server import ACCEPT_FAILED

MAX_CONNECTIONS = 16
# Short, so that the server closes the attack's connections soon; nothing asserts on time.
READ_TIMEOUT_S = 1
WAIT_S = 120


pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def pair(serve):
    """On the fake runner process: the HTTP guards are the worker's alone."""
    return serve("--http-max-connections", str(MAX_CONNECTIONS), "--http-header-timeout", str(READ_TIMEOUT_S),
                 "--http-body-timeout", str(READ_TIMEOUT_S), "--http-max-body-bytes-in-flight", str(MAX_BODY_BYTES),
                 fake_step_s=0.0, http=True)


def wait_for(condition, what: str, attack: object = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not seen within {WAIT_S} s: {what} ({attack})")
        time.sleep(0.05)


def grpc_answers(pair, stub) -> None:
    """A health check and a 1-step Generate, on fresh connections and on the warm one."""
    with grpc.insecure_channel(pair.worker.target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    response = stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", num_inference_steps=1, seed=1), timeout=60)
    assert len(response.images) == 1


def http_serves(pair) -> None:
    """The port serves again once the attack is gone (connections it left in the listen queue
    may still take the cap for a moment: a 503 is tried again)."""
    def models() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{pair.http_port}/v1/models", timeout=30) as answer:
                assert json.load(answer)["data"][0]["id"] == "tiny"
                return True
        except urllib.error.HTTPError as error:
            assert error.code == 503, error.code
            return False

    wait_for(models, "GET /v1/models answered 200")


def test_slowloris_connections_are_capped_and_closed_while_grpc_answers(pair, stub):
    with slowloris("127.0.0.1", pair.http_port, MAX_CONNECTIONS * 8) as attack:
        # Past the cap, connections are answered 503 at once; within it, closed for want of headers.
        wait_for(lambda: attack.answered[503] >= 1 and attack.closed_silently >= MAX_CONNECTIONS,
                 "503s and connections closed for want of headers", attack)
        grpc_answers(pair, stub)
        assert attack.failed == 0 and set(attack.answered) == {503}, attack
    http_serves(pair)
    log = pair.worker.log()
    assert "refused" in log and "--http-max-connections" in log
    assert "Too many open files" not in log


def test_partial_bodies_are_refused_past_the_budget_and_closed(pair, stub):
    declared = MAX_BODY_BYTES * 3 // 4  # two of them do not fit --http-max-body-bytes-in-flight
    with partial_bodies("127.0.0.1", pair.http_port, MAX_CONNECTIONS // 2, declared) as attack:
        wait_for(lambda: attack.answered[429] >= 1 and attack.closed_silently >= 1,
                 "429s and bodies closed for want of their end", attack)
        grpc_answers(pair, stub)
        assert attack.failed == 0 and set(attack.answered) <= {429, 503}, attack
        refusals: list[urllib.error.HTTPError] = []
        wait_for(lambda: big_body_refused(pair, declared, refusals), "a 429 for a body while the attack runs")
    error = refusals[0]
    assert error.headers["Retry-After"] == "1"
    body = json.load(error)["error"]
    assert body["code"] == "resource_exhausted" and "--http-max-body-bytes-in-flight" in body["message"]
    http_serves(pair)


def big_body_refused(pair, size: int, refusals: list[urllib.error.HTTPError]) -> bool:
    """Whether a body of ``size`` bytes is refused 429 (else it reached the prompt check: 400)."""
    body = json.dumps({"prompt": "x" * size}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{pair.http_port}/v1/images/generations", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30).close()
    except urllib.error.HTTPError as error:
        if error.code == 429:
            refusals.append(error)
            return True
        assert error.code == 400, error.code
    return False


def test_failed_accepts_log_one_throttled_line_and_grpc_answers(pair, stub):
    """The worker out of file descriptors: the HTTP port's failed accepts are one counted line,
    not a traceback per attempt, and gRPC answers on its open connection. The worker's limit is
    lowered to a few descriptors above what it holds (``prlimit``), then restored."""
    seen = len(pair.worker.log())
    fds = len(os.listdir(f"/proc/{pair.worker.pid}/fd"))
    original = resource.prlimit(pair.worker.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pair.worker.pid, resource.RLIMIT_NOFILE, (fds + 8, original[1]))
    try:
        with slowloris("127.0.0.1", pair.http_port, 64):
            wait_for(lambda: any(words in pair.worker.log()[seen:] for words in ("could not accept", ACCEPT_FAILED)),
                     "a failed accept in the log")
            response = stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", num_inference_steps=1), timeout=60)
            assert len(response.images) == 1
    finally:
        resource.prlimit(pair.worker.pid, resource.RLIMIT_NOFILE, original)
    log = pair.worker.log()[seen:]
    assert ACCEPT_FAILED not in log and "Traceback" not in log, log
    assert "out of file descriptors" in log
    http_serves(pair)
