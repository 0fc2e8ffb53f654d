"""Where a request's time went (issue 40): the runner's phases in every result, the worker's around
them, over gRPC, the HTTP API's extension and Prometheus; and the request-level path's phases."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import free_port, start_runner, start_worker

W = worker_pb2
PHASES = ("text_encode", "denoise", "decode", "to_host", "transfer", "encode")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A tiny model's worker on a step-batching runner (its text-to-image runs in the step engine)."""
    logs = tmp_path_factory.mktemp("timings")
    runner = start_runner(logs)
    port, metrics_port = free_port(), free_port()
    process = start_worker(logs, runner.target, "--model", "tiny", "--http-port", str(port),
                           "--metrics-port", str(metrics_port))
    process.extra.update(base_url=f"http://127.0.0.1:{port}/v1", metrics=f"http://127.0.0.1:{metrics_port}/metrics")
    yield process
    process.stop()
    runner.stop()


def _runner_phases_ran(timings: W.Timings) -> None:
    runner = timings.runner
    assert runner.text_encode_ms > 0 and runner.denoise_ms > 0 and runner.decode_ms > 0 and runner.to_host_ms > 0, \
        runner
    assert timings.transfer_ms >= 0 and timings.encode_ms > 0 and timings.total_ms >= timings.execute_ms


@pytest.mark.process
def test_every_grpc_result_says_where_its_time_went(worker):
    with grpc.insecure_channel(worker.target) as channel:
        response = worker_pb2_grpc.WorkerServiceStub(channel).Generate(
            W.GenerateRequest(prompt="a fox", num_inference_steps=2, width=64, height=64, seed=1), timeout=120)
    _runner_phases_ran(response.timings)
    assert response.timings.runner.denoise_ms < response.timings.execute_ms


@pytest.mark.process
def test_the_http_response_carries_the_timings_and_prometheus_has_each_phase(worker):
    client = openai.OpenAI(base_url=worker.extra["base_url"], api_key="none", max_retries=0, timeout=120)
    raw = client.images.with_raw_response.generate(prompt="a fox", size="64x64", response_format="b64_json")
    body = raw.http_response.json()
    assert raw.parse().data[0].b64_json, "the SDK still reads the response"
    timings = body["timings"]
    assert set(timings) >= {"queue_ms", "execute_ms", "encode_ms", "total_ms", "transfer_ms", "runner"}
    assert all(timings["runner"][f"{phase}_ms"] > 0 for phase in ("text_encode", "denoise", "decode", "to_host"))
    with urllib.request.urlopen(worker.extra["metrics"], timeout=5) as scraped:
        text = scraped.read().decode()
    counts = {sample.labels["phase"]: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name == "diffusion_phase_seconds_count"}
    assert set(counts) == set(PHASES) and all(count >= 1 for count in counts.values()), counts


@pytest.fixture(scope="module")
def tiny(cpu_platform):
    from runner_service.loaded_model import check_source, load_model
    from runner_service.model_roots import ModelRoots
    from runner_service.model_sources import HubCache

    return load_model(check_source("tiny", None, ModelRoots(), HubCache()), None, cpu_platform)


@pytest.mark.process
def test_a_request_level_batch_times_each_phase_of_the_pipeline_call(tiny):
    """The pipeline-call path (``--batching request``): the phases are cut where the pipeline's
    ``encode_prompt`` and VAE ``decode`` return and at its last step, and the hooks are gone after."""
    from runner_service.execution import run_checked
    from runner_service.limits import BatchLimits
    from tests.runner_calls import item

    result = run_checked(tiny, [item(seed=1, steps=2)], BatchLimits(), lambda _: None, threading.Event())
    timings = result.timings
    assert min(timings.text_encode_ms, timings.denoise_ms, timings.decode_ms, timings.to_host_ms) > 0, timings
    assert "encode_prompt" not in vars(tiny.pipeline) and "decode" not in vars(tiny.pipeline.vae)


@pytest.mark.unit
def test_a_phase_whose_end_is_not_seen_counts_in_the_next():
    from runner_service.execution import _phases
    from runner_service.phase_timing import PhaseSpans
    from runner_service.platforms import HostPoint

    spans = PhaseSpans()
    _phases(spans, {"start": HostPoint(1.0), "stepped": HostPoint(1.5)})  # no encode_prompt, no vae.decode seen
    timings = spans.resolve()
    assert timings.text_encode_ms == 0 and timings.denoise_ms == pytest.approx(500) and timings.decode_ms == 0
    assert timings.to_host_ms > 0
