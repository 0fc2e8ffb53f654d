"""Prometheus metrics over HTTP and the same statistics in GetStatus, moving with real traffic;
the request id travels from the worker to the runner's JSON log."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffusion.v1 import worker_pb2
from harness.processes import wait_until

pytestmark = pytest.mark.process
W = worker_pb2


@pytest.fixture(scope="module")
def pair(serve):
    return serve(runner_args=("--log-json",), metrics=True)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_with_traffic(pair, stub):
    url = pair.metrics_url
    before = scrape(url)
    assert ("diffusion_queue_depth", ()) in before
    assert value(before, "diffusion_runner_up", target=pair.runner.target) == 1
    response = stub.Generate(W.GenerateRequest(prompt="a fox", num_inference_steps=3, num_images=2, seed=1),
                             timeout=120)
    assert len(response.images) == 2
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(W.GenerateRequest(prompt="bad", width=7), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    events = list(stub.GenerateStream(W.GenerateStreamRequest(
        request=W.GenerateRequest(prompt="a stream", num_inference_steps=2, seed=2)), timeout=60))
    assert events[-1].HasField("done")
    # A request counts in flight until the runner's Execute call has ended, which may come after its
    # response reached the client.
    after = wait_until(lambda: (samples := scrape(url))["diffusion_requests_in_flight", ()] == 0 and samples, 30,
                       "no request in flight")

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("diffusion_requests_total", method="Generate", code="OK") == 1
    assert moved("diffusion_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert moved("diffusion_requests_total", method="GenerateStream", code="OK") == 1
    assert moved("diffusion_images_generated_total") == 3
    assert moved("diffusion_denoising_steps_total") == 5
    for histogram in ("diffusion_queue_seconds", "diffusion_execute_seconds", "diffusion_request_seconds"):
        assert moved(f"{histogram}_count") == 2
    assert moved("diffusion_execute_seconds_sum") > 0
    assert value(after, "diffusion_queue_depth") == 0
    assert value(after, "diffusion_requests_in_flight") == 0
    assert value(after, "diffusion_sleep_level") == 0
    assert value(after, "diffusion_worker_state", state="READY") == 1
    assert value(after, "diffusion_runner_memory_used_bytes", target=pair.runner.target) > 0
    assert ("diffusion_runner_restarts_total", (("target", pair.runner.target),)) in after


def test_get_status_carries_the_same_statistics(pair, stub):
    stub.Generate(W.GenerateRequest(prompt="counted", num_inference_steps=2, seed=3), timeout=60)
    statistics = stub.GetStatus(W.GetStatusRequest(), timeout=5).statistics
    samples = scrape(pair.metrics_url)
    assert statistics.images_generated == value(samples, "diffusion_images_generated_total") >= 1
    assert statistics.generations == value(samples, "diffusion_request_seconds_count")
    assert statistics.execute_ms_total > 0
    assert statistics.execute_ms_mean == pytest.approx(statistics.execute_ms_total / statistics.generations)
    assert statistics.queue_ms_mean == pytest.approx(statistics.queue_ms_total / statistics.generations)
    counts = {(c.method, c.code): c.count for c in statistics.requests}
    assert counts[("Generate", "OK")] == value(samples, "diffusion_requests_total", method="Generate", code="OK")
    again = stub.GetStatus(W.GetStatusRequest(), timeout=5).statistics
    assert {(c.method, c.code): c.count for c in again.requests}[("GetStatus", "OK")] >= 1  # the call before


def test_the_request_id_reaches_the_runner_log(pair, stub):
    runner = pair.runner
    stub.Generate(W.GenerateRequest(request_id="trace-me-42", prompt="traced", num_inference_steps=1, seed=4),
                  timeout=60)

    def traced() -> list[dict]:
        lines = [json.loads(line) for line in runner.log().splitlines() if line.startswith("{")]
        return [entry for entry in lines if entry.get("request_id") == "trace-me-42"]

    entries = wait_until(traced, 30, "the request id in the runner log")
    assert any(entry["message"].startswith("execute 1 request") for entry in entries)


def test_a_callers_x_request_id_metadata_names_a_request_without_an_id_of_its_own(pair, stub):
    """A gateway's or a mesh's id, as the HTTP API's header: the request's id, to the runner's log;
    the message's own id wins; one no request could carry is refused naming the metadata."""
    reply = stub.Generate(W.GenerateRequest(prompt="meshed", num_inference_steps=1, seed=5), timeout=60,
                          metadata=[("x-request-id", "mesh-9c1")])
    assert reply.request_id == "mesh-9c1"
    wait_until(lambda: any(json.loads(line).get("request_id") == "mesh-9c1"
                           for line in pair.runner.log().splitlines() if line.startswith("{")),
               30, "the caller's id in the runner log")
    own = stub.Generate(W.GenerateRequest(request_id="own-1", prompt="meshed", num_inference_steps=1, seed=5),
                        timeout=60, metadata=[("x-request-id", "mesh-9c2")])
    assert own.request_id == "own-1"
    for stream in (False, True):
        request = W.GenerateRequest(prompt="meshed", num_inference_steps=1)
        with pytest.raises(grpc.RpcError) as refused:
            if stream:
                list(stub.GenerateStream(W.GenerateStreamRequest(request=request), timeout=60,
                                         metadata=[("x-request-id", "x" * 129)]))
            else:
                stub.Generate(request, timeout=60, metadata=[("x-request-id", "x" * 129)])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("x-request-id: must be at most 128 characters")
