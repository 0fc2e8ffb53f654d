"""TaylorSeer served end to end: a worker started with ``--cache taylorseer`` alone on a real runner
serving ``shapes`` loads the method's default, and requests with their own interval
(``cache_threshold``; 0: off) share a step-level batch that two of them join late. Each image equals
the image the pipeline's own ``__call__`` draws for it alone with the runner's TaylorSeer cache at its
interval (its last step computed: each row's own, joined late or not), within 2/255; the one with
caching off equals the plain image. An interval that is not a whole number is refused naming the
field, over gRPC and over HTTP (the real ``openai`` SDK)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from diffusion.v1 import common_pb2, worker_pb2
from runner_service.acceleration.taylorseer_cache import TaylorSeerCache
from runner_service.denoising.loop import max_sequence_length
from runner_service.models.catalog import ensure_builtin
from serving_common.errors import field_violations
from serving_common.input_rules import CACHE_DEFAULTS, TAYLORSEER
from step_batches import served_joining
from support import Pair

W = worker_pb2
# 11 steps: the last (step 10) is off the schedules of both intervals after the default 4 warmup
# steps (3: steps 5 and 8; 2: steps 5, 7 and 9), so each row computes it by the last-step rule.
SIZE, STEPS = 64, 11
PROMPTS = ["a red circle on a blue background", "a green square on the left on a white background",
           "a yellow triangle at the top on a black background"]
DEFAULT = CACHE_DEFAULTS[TAYLORSEER]
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]


@pytest.fixture(scope="module")
def pair(serve: Callable[..., Pair]) -> Pair:
    return serve("--model", "shapes", "--cache", TAYLORSEER, "--max-batch-size", "4", http=True)


def generate(index: int, request_id: str, **fields: Any) -> W.GenerateRequest:
    return W.GenerateRequest(request_id=request_id, prompt=PROMPTS[index], seed=index, width=SIZE, height=SIZE,
                             num_inference_steps=STEPS, guidance_scale=4.0, output_format=W.OUTPUT_FORMAT_RAW,
                             **fields)


def draw_alone(pipeline: FluxPipeline, index: int, interval: float) -> np.ndarray:
    """Image ``index`` by the pipeline's own call with TaylorSeer at ``interval`` (0: plain)."""
    cache = TaylorSeerCache(pipeline.transformer, interval, DEFAULT.warmup_steps)
    try:
        with torch.inference_mode(), cache.pipeline_call([interval], STEPS) if interval else contextlib.nullcontext():
            images = pipeline(prompt=PROMPTS[index], negative_prompt="", true_cfg_scale=4.0, width=SIZE, height=SIZE,
                              num_inference_steps=STEPS, generator=torch.Generator().manual_seed(index),
                              output_type="np", **max_sequence_length(pipeline)).images
    finally:
        cache.remove()
    return np.asarray((images[0] * 255).round().clip(0, 255).astype(np.uint8))


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def test_the_cache_flag_alone_loads_the_default_and_each_request_keeps_its_own_interval(stub):
    (runner,) = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners
    assert runner.info.model.acceleration == common_pb2.Acceleration(
        cache=TAYLORSEER, cache_threshold=DEFAULT.threshold, cache_warmup_steps=DEFAULT.warmup_steps)
    assert TAYLORSEER in runner.info.model.acceleration_offer.cache_methods
    images = served_joining(stub, generate(0, "model-interval"), [generate(1, "interval-2", cache_threshold=2.0),
                                                                  generate(2, "uncached", cache_threshold=0.0)])
    pipeline = FluxPipeline.from_pretrained(ensure_builtin("shapes"), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    expected = [draw_alone(pipeline, 0, DEFAULT.threshold), draw_alone(pipeline, 1, 2.0), draw_alone(pipeline, 2, 0.0)]
    assert max(largest_difference(image, wanted) for image, wanted in zip(images, expected, strict=True)) <= 2
    assert largest_difference(images[0], draw_alone(pipeline, 0, 0.0)) > 2, "the cache changed the cached image"


def test_an_interval_that_is_not_whole_is_refused_naming_the_field(pair, stub):
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(generate(0, "half-interval", cache_threshold=2.5), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "whole number" in field_violations(cast(grpc.Call, refused.value))["cache_threshold"]
    client = openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt=PROMPTS[0], size=f"{SIZE}x{SIZE}", extra_body={"cache_threshold": 2.5})
    assert caught.value.body["param"] == "cache_threshold", caught.value.body  # type: ignore[index]
