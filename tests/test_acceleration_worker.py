"""The worker's part of acceleration, on the fake runner (``tests/fake_runner.py``, which offers and
echoes acceleration like a runner): the --model flags reach LoadModel, InitRequest.acceleration is kept
across a worker restart, a runner's refusal comes back unchanged with the model serving on,
``cache_threshold`` is checked over gRPC and HTTP (the real ``openai`` SDK), and the step cache's
metrics."""

from __future__ import annotations

import contextlib
import json
import math
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import ServiceProcess, free_port, start_fake_runner, start_worker, wait_until, worker_stub
from serving_common.errors import field_violations
from serving_common.input_rules import CACHE_DEFAULTS, FIRST_BLOCK_CACHE
from support import cli
from worker_service.desired_state import DesiredState
from worker_service.state_store import StateStore

pytestmark = pytest.mark.process
FLAGS = ("--cache", "first_block_cache", "--cache-threshold", "0.1", "--cache-warmup-steps", "2", "--compile",
         "--quantization", "int8-weight-only", "--attention-backend", "native")
FLAGGED = common_pb2.Acceleration(cache="first_block_cache", cache_threshold=0.1, cache_warmup_steps=2, compile=True,
                                  quantization="int8-weight-only", attention_backend="native")
STEPS = 6


@contextlib.contextmanager
def serving(log_dir: Path, *flags: str) -> Iterator[ServiceProcess]:
    """A fake runner and a worker on it serving ``shapes`` with ``flags``, HTTP and metrics on."""
    runner = start_fake_runner(log_dir)
    port, metrics_port = free_port(), free_port()
    try:
        worker = start_worker(log_dir, runner.target, "--model", "shapes", "--http-port", str(port),
                              "--metrics-port", str(metrics_port), "--runner-poll-interval", "0.1", *flags)
    except BaseException:
        runner.stop()
        raise
    worker.extra.update(base_url=f"http://127.0.0.1:{port}/v1", metrics=f"http://127.0.0.1:{metrics_port}/metrics",
                        runner=runner.target)
    try:
        yield worker
    finally:
        worker.stop()
        runner.stop()


@pytest.fixture(scope="module")
def accelerated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with serving(tmp_path_factory.mktemp("accelerated"), *FLAGS) as worker:
        yield worker


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with serving(tmp_path_factory.mktemp("plain")) as worker:
        yield worker


def status(worker: ServiceProcess) -> worker_pb2.GetStatusResponse:
    with worker_stub(worker.target, warm=False) as stub:
        response: worker_pb2.GetStatusResponse = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    return response


def generate(worker: ServiceProcess, **fields: Any) -> worker_pb2.GenerateResponse:
    with worker_stub(worker.target, warm=False) as stub:
        response: worker_pb2.GenerateResponse = stub.Generate(worker_pb2.GenerateRequest(
            prompt="a red circle", width=16, height=16, num_inference_steps=STEPS, **fields), timeout=30)
    return response


def refused_fields(worker: ServiceProcess, **fields: Any) -> dict[str, str]:
    """The field violations of a Generate with ``fields``, which must be INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as refused:
        generate(worker, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    return field_violations(cast(grpc.Call, refused.value))


def sdk(worker: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.extra["base_url"], api_key="unused", max_retries=0, timeout=30)


def http_generate(worker: ServiceProcess, threshold: float) -> None:
    sdk(worker).images.generate(prompt="a red circle", size="16x16",  # type: ignore[arg-type]
                                extra_body={"num_inference_steps": STEPS, "cache_threshold": threshold})


def cache_counters(worker: ServiceProcess) -> tuple[float, float] | None:
    """The runner's (rows, skipped) of the step cache from the metrics; None when they are absent."""
    with urllib.request.urlopen(worker.extra["metrics"], timeout=5) as response:
        text = response.read().decode()
    samples = {(s.name, s.labels.get("target")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    target = worker.extra["runner"]
    if ("diffusion_runner_cache_rows_total", target) not in samples:
        return None
    return samples["diffusion_runner_cache_rows_total", target], samples["diffusion_runner_cache_skipped_total", target]


def test_the_model_flags_reach_the_runners_load_model(accelerated):
    (runner,) = status(accelerated).runners
    assert runner.info.model.acceleration == FLAGGED
    assert "first_block_cache" in runner.info.model.acceleration_offer.cache_methods


def test_the_cache_flag_alone_loads_the_methods_default(tmp_path):
    default = CACHE_DEFAULTS[FIRST_BLOCK_CACHE]
    with serving(tmp_path, "--cache", FIRST_BLOCK_CACHE) as worker:
        (runner,) = status(worker).runners
        assert runner.info.model.acceleration == common_pb2.Acceleration(
            cache=FIRST_BLOCK_CACHE, cache_threshold=default.threshold, cache_warmup_steps=default.warmup_steps)
        assert generate(worker).images


def test_a_refused_acceleration_is_the_runners_status_and_the_model_serves_on(accelerated):
    with worker_stub(accelerated.target, warm=False) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.Init(worker_pb2.InitRequest(model="shapes", acceleration=common_pb2.Acceleration(
            quantization="float8-weight-only", attention_backend="flash")), timeout=30)  # names the worker knows
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(cast(grpc.Call, refused.value))
    assert sorted(violations) == ["acceleration.attention_backend", "acceleration.quantization"]
    assert "FakePipeline cannot take 'float8-weight-only'" in violations["acceleration.quantization"]
    assert generate(accelerated).images
    assert status(accelerated).runners[0].info.model.acceleration == FLAGGED


@pytest.mark.parametrize("threshold", [-0.1, float("nan"), float("inf")])
def test_a_threshold_that_is_no_threshold_is_refused(accelerated, threshold):
    assert "cache_threshold" in refused_fields(accelerated, cache_threshold=threshold)
    if not math.isfinite(threshold):
        return  # JSON has no NaN or infinity
    with pytest.raises(openai.BadRequestError) as caught:
        http_generate(accelerated, threshold)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "cache_threshold"  # type: ignore[index]


def test_a_threshold_above_0_needs_a_model_with_a_cache(plain):
    assert "acceleration.cache" in refused_fields(plain, cache_threshold=0.2)["cache_threshold"]
    with pytest.raises(openai.BadRequestError) as caught:
        http_generate(plain, 0.2)
    assert caught.value.body["param"] == "cache_threshold"  # type: ignore[index]
    assert generate(plain, cache_threshold=0.0).images
    http_generate(plain, 0.0)
    assert cache_counters(plain) is None, "a model without a cache has no cache metrics"


def test_each_request_reaches_the_runner_with_its_threshold_and_the_metrics_count_its_rows(accelerated):
    """The fake runner skips a row at every even step after the warm-up (2) at a threshold above 0:
    none at threshold 0, 2 of the 6 at the model's threshold and at a request's own, over gRPC and HTTP."""
    calls: list[tuple[Callable[[], object], int]] = [
        (lambda: generate(accelerated, cache_threshold=0.0), 0), (lambda: generate(accelerated), 2),
        (lambda: generate(accelerated, cache_threshold=0.5), 2), (lambda: http_generate(accelerated, 0.0), 0),
        (lambda: http_generate(accelerated, 0.5), 2)]
    for index, (call, skipped) in enumerate(calls):
        rows_before, skipped_before = wait_until(lambda: cache_counters(accelerated), 10, "the cache metrics")
        call()
        rows, skipped_after = wait_until(partial(counted, accelerated, rows_before + STEPS), 10, "the rows")
        assert (rows - rows_before, skipped_after - skipped_before) == (STEPS, skipped), index


def counted(worker: ServiceProcess, rows: float) -> tuple[float, float] | None:
    """The cache counters once they show at least ``rows`` rows."""
    found = cache_counters(worker)
    return found if found is not None and found[0] >= rows else None


def test_the_cli_inits_with_acceleration_and_a_restarted_worker_keeps_it(tmp_path):
    """``diffusion init`` with every acceleration flag; a new worker on the same state file loads a
    fresh runner with it (the --model flags without acceleration lose to the saved state)."""
    state = ("--state-file", str(tmp_path / "state.json"))
    with serving(tmp_path, *state) as worker:
        done = cli("--target", worker.target, "init", "shapes", "--cache", "first_block_cache", "--cache-threshold",
                   "0.2", "--cache-warmup-steps", "1", "--compile", "--quantization", "int8-weight-only",
                   "--attention-backend", "native")
        assert done.returncode == 0, done.stderr
        shown = json.loads(cli("--target", worker.target, "status", "--json").stdout)
    wanted = common_pb2.Acceleration(cache="first_block_cache", cache_threshold=0.2, cache_warmup_steps=1,
                                     compile=True, quantization="int8-weight-only", attention_backend="native")
    assert json.loads(done.stdout)["model"]["acceleration"]["cache"] == "first_block_cache"
    assert shown["runners"][0]["info"]["model"]["accelerationOffer"]["cacheMethods"] == ["first_block_cache"]
    with serving(tmp_path, *state) as restarted:
        assert status(restarted).runners[0].info.model.acceleration == wanted
        assert generate(restarted, cache_threshold=0.3).images


def test_a_state_file_written_before_acceleration_loads_as_plain(tmp_path):
    path = tmp_path / "state.json"
    StateStore(str(path)).save(DesiredState("shapes", common_pb2.DTYPE_UNSPECIFIED, {"cache": "first_block_cache"}))
    saved = json.loads(path.read_text())
    del saved["acceleration"]
    path.write_text(json.dumps(saved))
    loaded = StateStore(str(path)).load()
    assert loaded is not None and loaded.model == "shapes"
    assert loaded.acceleration_message() == common_pb2.Acceleration()


def test_a_state_file_whose_acceleration_does_not_parse_is_ignored(tmp_path):
    path = tmp_path / "state.json"
    StateStore(str(path)).save(DesiredState("shapes", common_pb2.DTYPE_UNSPECIFIED, {"cache": "first_block_cache"}))
    saved = json.loads(path.read_text())
    saved["acceleration"] = {"no_such_field": 1}
    path.write_text(json.dumps(saved))
    assert StateStore(str(path)).load() is None
