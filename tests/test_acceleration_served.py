"""The step cache served end to end: ``shapes`` Init'ed through the worker with
``first_block_cache``, requests with their own ``cache_threshold`` (0: off), in a step-level
batch that a request joins late and in one request-level batch. Each image equals the image the
pipeline's own ``__call__`` draws for it alone with diffusers' hooks' rule at that threshold (the
runner's row cache, outside any server), within 2/255; one with caching off equals the plain image."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from PIL import Image

from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import free_port, start_runner, start_worker, wait_until, worker_stub
from harness.streams import Stream
from runner_service.acceleration.row_cache import RowCache
from runner_service.denoising.loop import max_sequence_length
from runner_service.models.catalog import ensure_builtin
from serving_common.input_rules import CACHE_DEFAULTS, FIRST_BLOCK_CACHE
from step_batches import served_joining
from support import cli, pixels

W = worker_pb2
SIZE, STEPS, THRESHOLD = 64, 12, 0.2
PROMPTS = ["a red circle on a blue background", "a green square on the left on a white background",
           "a yellow triangle at the top on a black background"]
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]


def generate(index: int, request_id: str, **fields: Any) -> W.GenerateRequest:
    defaults: dict[str, Any] = dict(request_id=request_id, prompt=PROMPTS[index], seed=index, width=SIZE,
                                    height=SIZE, num_inference_steps=STEPS, guidance_scale=4.0,
                                    output_format=W.OUTPUT_FORMAT_RAW)
    return W.GenerateRequest(**{**defaults, **fields})


ACCELERATION = common_pb2.Acceleration(cache=FIRST_BLOCK_CACHE, cache_threshold=THRESHOLD)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A ``step`` and a ``request`` batching runner, each behind its worker, Init'ed with the cache."""
    log_dir = tmp_path_factory.mktemp("acceleration-served")
    with contextlib.ExitStack() as stack:
        served = {}
        for name, runner_args in {"step": (), "request": ("--batching", "request")}.items():
            runner = start_runner(log_dir, *runner_args)
            stack.callback(runner.stop)
            ports = {"http": free_port(), "metrics": free_port()}
            worker = start_worker(log_dir, runner.target, "--model", "shapes", "--max-batch-size", "4",
                                  "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]))
            stack.callback(worker.stop)
            stub = stack.enter_context(worker_stub(worker.target))
            response = stub.Init(W.InitRequest(model="shapes", acceleration=ACCELERATION), timeout=120)
            assert response.model.acceleration == ACCELERATION
            assert FIRST_BLOCK_CACHE in response.model.acceleration_offer.cache_methods
            served[name] = stub
            served[f"{name}-ports"] = ports
            served[f"{name}-target"] = worker.target
        yield served


@pytest.fixture(scope="module")
def alone() -> Callable[..., np.ndarray]:
    """``draw_alone`` on one pipeline, each image drawn once for the module: several tests compare
    with the same image (request 1 at 0.3, request 2 uncached, ...)."""
    pipeline = FluxPipeline.from_pretrained(ensure_builtin("shapes"), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return functools.cache(functools.partial(draw_alone, pipeline))


def draw_alone(pipeline: FluxPipeline, index: int, threshold: float, warmup_steps: int = 0) -> np.ndarray:
    """Image ``index`` by the pipeline's own call, with the row cache at ``threshold`` (0: none)."""
    cache = RowCache(pipeline.transformer, threshold, warmup_steps) if threshold else None
    try:
        with torch.inference_mode(), cache.pipeline_call([threshold], STEPS) if cache else contextlib.nullcontext():
            images = pipeline(prompt=PROMPTS[index], negative_prompt="", true_cfg_scale=4.0, width=SIZE, height=SIZE,
                              num_inference_steps=STEPS, generator=torch.Generator().manual_seed(index),
                              output_type="np", **max_sequence_length(pipeline)).images
    finally:
        if cache is not None:
            cache.remove()
    return np.asarray((images[0] * 255).round().clip(0, 255).astype(np.uint8))


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def test_each_request_of_a_step_batch_caches_at_its_own_threshold(stubs, alone):
    """Request 0 runs at the model's threshold; once it has run 3 steps, request 1 (threshold 0.3)
    and request 2 (caching off) join its batch."""
    stub = stubs["step"]
    images = served_joining(stub, generate(0, "cached-0"), [generate(1, "cached-1", cache_threshold=0.3),
                                                            generate(2, "cached-2", cache_threshold=0.0)])
    expected = [alone(0, THRESHOLD), alone(1, 0.3), alone(2, 0.0)]
    assert max(largest_difference(image, wanted) for image, wanted in zip(images, expected, strict=True)) <= 2
    assert largest_difference(images[0], alone(0, 0.0)) > 2, "the cache changed the cached request's image"


def test_requests_of_one_request_level_batch_cache_apart(stubs, alone):
    """Three requests queue behind a long one and go to the runner as one pipeline call."""
    stub = stubs["request"]
    holder = Stream(stub, generate(0, "holder", num_inference_steps=500))
    holder.wait_step(1)
    streams = [Stream(stub, generate(index, f"batched-{index}", cache_threshold=threshold))
               for index, threshold in enumerate([THRESHOLD, 0.3, 0.0])]
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=10).queue_depth == 3, 60, "the three queued")
    stub.Cancel(W.CancelRequest(request_id="holder"), timeout=10)
    holder.join()
    for stream, (index, threshold) in zip(streams, enumerate([THRESHOLD, 0.3, 0.0]), strict=True):
        stream.finish(120)
        assert stream.done is not None, stream.error
        assert largest_difference(pixels(stream.done), alone(index, threshold)) <= 2, index


def test_an_acceleration_the_model_cannot_take_is_refused_and_the_cached_model_serves_on(stubs):
    stub = stubs["step"]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Init(W.InitRequest(model="shapes", acceleration=common_pb2.Acceleration(
            cache="no_such_cache", cache_threshold=0.1)), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "acceleration.cache" in (refused.value.details() or "")
    response = stub.Generate(generate(0, "after-refusal"), timeout=120)
    assert response.images
    status = stub.GetStatus(W.GetStatusRequest(), timeout=10)
    assert any(runner.info.model.acceleration == ACCELERATION for runner in status.runners)


def test_the_openai_api_takes_a_cache_threshold_and_the_metrics_count_skipped_rows(stubs, alone):
    ports = stubs["step-ports"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    fields = {"seed": 1, "num_inference_steps": STEPS, "guidance_scale": 4.0}
    result = client.images.generate(prompt=PROMPTS[1], size=f"{SIZE}x{SIZE}",
                                    extra_body={**fields, "cache_threshold": 0.3})
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or ""))).convert("RGB"))
    assert largest_difference(image, alone(1, 0.3)) <= 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt=PROMPTS[1], size=f"{SIZE}x{SIZE}", extra_body={"cache_threshold": -1})
    assert refused.value.body["param"] == "cache_threshold", refused.value.body  # type: ignore[index]

    def counted() -> tuple[float, float] | None:
        """(rows, skipped) as the metrics show them, once the runner's refreshed info has both."""
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        found = [re.search(rf'^diffusion_runner_cache_{name}_total\{{target="[^"]+"\}} (\S+)$', metrics, re.M)
                 for name in ("rows", "skipped")]
        return (float(found[0][1]), float(found[1][1])) if found[0] and found[1] and float(found[1][1]) else None

    wait_until(counted, 60, "the metrics counting skipped rows")
    rows, skipped = counted() or (0.0, 0.0)
    assert 0 < skipped < rows


def test_the_cli_inits_with_acceleration_and_generates_at_a_threshold(stubs, alone, tmp_path):
    target = stubs["request-target"]
    done = cli("--target", target, "init", "shapes", "--cache", "first_block_cache", "--cache-threshold", "0.2",
               "--cache-warmup-steps", "2")
    assert done.returncode == 0, done.stderr
    acceleration = json.loads(done.stdout)["model"]["acceleration"]
    assert acceleration["cache"] == "first_block_cache" and acceleration["cacheWarmupSteps"] == 2, acceleration
    output = tmp_path / "uncached.png"
    done = cli("--target", target, "generate", PROMPTS[2], "-o", str(output), "--seed", "2", "--steps", str(STEPS),
               "--guidance", "4", "--width", str(SIZE), "--height", str(SIZE), "--cache-threshold", "0")
    assert done.returncode == 0, done.stderr
    assert largest_difference(np.asarray(Image.open(output).convert("RGB")), alone(2, 0.0)) <= 2


def test_a_cache_alone_loads_with_its_methods_default_and_serves(stubs, alone):
    """Init with ``first_block_cache`` and no threshold: the model reports the method's default
    threshold and warmup steps, and draws as the pipeline does with them."""
    stub = stubs["step"]
    default = CACHE_DEFAULTS[FIRST_BLOCK_CACHE]
    try:
        response = stub.Init(W.InitRequest(model="shapes", acceleration=common_pb2.Acceleration(
            cache=FIRST_BLOCK_CACHE)), timeout=120)
        assert response.model.acceleration == common_pb2.Acceleration(
            cache=FIRST_BLOCK_CACHE, cache_threshold=default.threshold, cache_warmup_steps=default.warmup_steps)
        done = stub.Generate(generate(0, "default-threshold"), timeout=120)
        assert largest_difference(pixels(done), alone(0, default.threshold, default.warmup_steps)) <= 2
    finally:
        stub.Init(W.InitRequest(model="shapes", acceleration=ACCELERATION), timeout=120)
