"""The per-row TaylorSeer cache on the trained shapes model (a Flux transformer), in process: one
image computes and predicts exactly as diffusers' own hook in lite mode with its last step computed
(``disable_cache_after_step``), at its default it stays close to plain, an interval of 0 is plain,
and inside a step-level batch every image keeps its own schedule, last step and Taylor factors, also
one that joins late or turns caching off."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from diffusers import TaylorSeerCacheConfig
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from runner_service.acceleration.apply import offer
from runner_service.acceleration.taylorseer_cache import TaylorSeerCache
from runner_service.denoising.loop import SequenceSpec, max_sequence_length
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families.flux.loop import FluxLoop
from runner_service.models.catalog import ensure_builtin
from runner_service.platforms import select_platform
from serving_common.input_rules import CACHE_DEFAULTS, TAYLORSEER
from step_batches import denoised_alone, denoised_joining

pytestmark = pytest.mark.unit

# 9 steps: the last (step 8) is off both intervals' schedules (interval 3 after 2 computes steps 0,
# 1, 3 and 6; interval 2 after 2 steps 0, 1, 3, 5 and 7), so it computes by the last-step rule alone.
SIZE, STEPS, INTERVAL, WARMUP = 64, 9, 3, 2
PROMPTS = ["a red circle on a blue background", "a green square at the top left on a white background",
           "a yellow triangle at the bottom right on a black background"]
# The least PSNR against plain of an image at the method's default, 20 steps (the bench's setting):
# the rule for defaults (docs/acceleration.md has the figures over 16 scenes; this image: 46.6 dB).
DEFAULT_PSNR_DB = 35.0


@pytest.fixture(scope="module")
def pipeline() -> FluxPipeline:
    loaded = FluxPipeline.from_pretrained(ensure_builtin("shapes"), dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.fixture
def cache(pipeline: FluxPipeline) -> Iterator[TaylorSeerCache]:
    attached = TaylorSeerCache(pipeline.transformer, INTERVAL, WARMUP)
    yield attached
    attached.remove()


def pixels(images: np.ndarray) -> np.ndarray:
    return np.asarray((images * 255).round().clip(0, 255).astype(np.uint8))


def call(pipeline: FluxPipeline, index: int, guidance: float, steps: int = STEPS) -> np.ndarray:
    """Image ``index`` through the pipeline's own ``__call__``, as the runner calls it."""
    with torch.inference_mode():
        images = pipeline(prompt=PROMPTS[index], negative_prompt="", true_cfg_scale=guidance, width=SIZE, height=SIZE,
                          num_inference_steps=steps, generator=torch.Generator().manual_seed(index), output_type="np",
                          **max_sequence_length(pipeline)).images
    return pixels(images)[0]


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def psnr_db(first: np.ndarray, second: np.ndarray) -> float:
    error = float(np.mean((first.astype(np.float64) - second) ** 2))
    return math.inf if error == 0 else 10 * math.log10(255 ** 2 / error)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["unguided", "true-cfg"])
def test_one_image_predicts_as_diffusers_lite_mode(pipeline: FluxPipeline, guidance: float) -> None:
    pipeline.transformer.enable_cache(TaylorSeerCacheConfig(
        cache_interval=INTERVAL, disable_cache_before_step=WARMUP, disable_cache_after_step=STEPS - 1,
        use_lite_mode=True, taylor_factors_dtype=torch.float32))
    try:
        expected = call(pipeline, 0, guidance)
    finally:
        pipeline.transformer.disable_cache()
    plain = call(pipeline, 0, guidance)
    cache = TaylorSeerCache(pipeline.transformer, INTERVAL, WARMUP)
    try:
        with cache.pipeline_call([INTERVAL], STEPS):
            cached = call(pipeline, 0, guidance)
    finally:
        cache.remove()
    rows = 2 if guidance > 1 else 1  # true CFG calls the transformer per branch
    assert cache.rows_skipped == 4 * rows, "each row predicts steps 2, 4, 5 and 7; computes its last, 8"
    assert largest_difference(expected, cached) == 0
    assert largest_difference(plain, cached) > 0
    assert largest_difference(plain, call(pipeline, 0, guidance)) == 0, "removing the cache restores the model"


def test_the_default_stays_close_to_plain_and_an_interval_of_0_is_plain(pipeline: FluxPipeline) -> None:
    default = CACHE_DEFAULTS[TAYLORSEER]
    cache = TaylorSeerCache(pipeline.transformer, default.threshold, default.warmup_steps)
    try:
        images = {}
        for interval in (default.threshold, 0.0):
            with cache.pipeline_call([interval], 20):
                images[interval] = call(pipeline, 1, 4.0, steps=20)
    finally:
        cache.remove()
    plain = call(pipeline, 1, 4.0, steps=20)
    assert cache.rows_skipped > 0
    assert psnr_db(plain, images[default.threshold]) >= DEFAULT_PSNR_DB
    assert largest_difference(plain, images[0.0]) == 0


def run_alone(loop: FluxLoop, cache: TaylorSeerCache, spec: SequenceSpec) -> np.ndarray:
    return denoised_alone(loop, cache, spec, first_pixels)


def first_pixels(decoded: torch.Tensor) -> np.ndarray:
    return pixels(decoded.numpy())[0]


def test_rows_of_a_step_batch_keep_their_own_factors(pipeline: FluxPipeline, cache: TaylorSeerCache) -> None:
    """Image 0 starts alone; image 1 (interval 2) joins at step 3; image 2 joins at step 5 with
    caching off. Each equals its image denoised alone (and the uncached one the plain image): a late
    joiner computes its own warmup and its own last step, and never predicts from another row's
    factors."""
    loop = FluxLoop(pipeline, torch.device("cpu"))
    specs = [SequenceSpec(PROMPTS[0], "", SIZE, SIZE, STEPS, 4.0, 0, ()),
             SequenceSpec(PROMPTS[1], "", SIZE, SIZE, STEPS, 1.0, 1, (), cache_threshold=2.0),
             SequenceSpec(PROMPTS[2], "", SIZE, SIZE, STEPS, 4.0, 2, (), cache_threshold=0.0)]
    with torch.inference_mode():
        alone = [run_alone(loop, cache, spec) for spec in specs]
        skipped_before = cache.rows_skipped
        finished = denoised_joining(loop, cache, specs[0], {3: specs[1], 5: specs[2]}, first_pixels)
    assert cache.rows_skipped > skipped_before
    assert max(largest_difference(finished[index], alone[index]) for index in range(3)) <= 2
    assert largest_difference(alone[0], call(pipeline, 0, 4.0)) > 2, "the cache changes image 0"
    assert largest_difference(alone[2], call(pipeline, 2, 4.0)) <= 2, "caching off is the plain image"


def test_states_are_kept_for_the_running_rows_only(pipeline: FluxPipeline, cache: TaylorSeerCache) -> None:
    loop = FluxLoop(pipeline, torch.device("cpu"))
    with torch.inference_mode():
        first = loop.start(SequenceSpec(PROMPTS[0], "", SIZE, SIZE, 2, 4.0, 0, ()), PromptCache(0), "")
        second = loop.start(SequenceSpec(PROMPTS[1], "", SIZE, SIZE, 3, 1.0, 1, ()), PromptCache(0), "")
        loop.step([first, second], cache)
        assert cache.rows_run == 3  # two guided rows and one
        while not second.finished:
            loop.step([first, second], cache)
    assert first.finished
    assert cache.live_rows == 1, "the finished guided sequence's two rows were dropped"


def test_transformers_with_an_output_projection_are_offered_it(pipeline: FluxPipeline) -> None:
    assert TaylorSeerCache.supports(pipeline.transformer)
    assert TAYLORSEER in offer(pipeline, select_platform("cpu")).cache_methods
    assert not TaylorSeerCache.supports(pipeline.vae)
    with pytest.raises(ValueError, match="no described transformer blocks"):
        TaylorSeerCache(pipeline.vae, INTERVAL, WARMUP)
