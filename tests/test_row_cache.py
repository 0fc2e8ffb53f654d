"""The per-row First Block Cache on the trained shapes model (a Flux transformer), in process:
one image caches exactly as diffusers' own hook, and inside a step-level batch every image keeps
its own decisions, also one that joins late or turns caching off (and so with the Dual Block
Cache, tests/test_dual_block_cache.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from diffusers import FirstBlockCacheConfig
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from runner_service.acceleration.row_cache import DualBlockCache, RowCache
from runner_service.denoising.loop import SequenceSpec, max_sequence_length
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families.flux.loop import FluxLoop
from runner_service.models.catalog import ensure_builtin
from step_batches import denoised_alone, denoised_joining

pytestmark = pytest.mark.unit

SIZE, STEPS, THRESHOLD = 64, 10, 0.2
PROMPTS = ["a red circle on a blue background", "a green square at the top left on a white background",
           "a yellow triangle at the bottom right on a black background"]


@pytest.fixture(scope="module")
def pipeline() -> FluxPipeline:
    loaded = FluxPipeline.from_pretrained(ensure_builtin("shapes"), dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.fixture
def cache(pipeline: FluxPipeline, request: pytest.FixtureRequest) -> Iterator[RowCache]:
    """The First Block Cache, or the class a test names (``indirect``) on the same transformer."""
    attached = getattr(request, "param", RowCache)(pipeline.transformer, THRESHOLD, 0)
    yield attached
    attached.remove()


def pixels(images: np.ndarray) -> np.ndarray:
    return np.asarray((images * 255).round().clip(0, 255).astype(np.uint8))


def call(pipeline: FluxPipeline, index: int, guidance: float) -> np.ndarray:
    """Image ``index`` through the pipeline's own ``__call__``, as the runner calls it."""
    with torch.inference_mode():
        images = pipeline(prompt=PROMPTS[index], negative_prompt="", true_cfg_scale=guidance, width=SIZE, height=SIZE,
                          num_inference_steps=STEPS, generator=torch.Generator().manual_seed(index), output_type="np",
                          **max_sequence_length(pipeline)).images
    return pixels(images)[0]


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["unguided", "true-cfg"])
def test_one_image_caches_as_diffusers_hook(pipeline: FluxPipeline, guidance: float) -> None:
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
    try:
        expected = call(pipeline, 0, guidance)
    finally:
        pipeline.transformer.disable_cache()
    plain = call(pipeline, 0, guidance)
    cache = RowCache(pipeline.transformer, THRESHOLD, 0)
    try:
        with cache.pipeline_call([THRESHOLD], STEPS):
            cached = call(pipeline, 0, guidance)
    finally:
        cache.remove()
    assert cache.rows_skipped > 0, "the threshold skips some steps on this image"
    assert largest_difference(expected, cached) == 0
    assert largest_difference(plain, cached) > 0
    assert largest_difference(plain, call(pipeline, 0, guidance)) == 0, "removing the cache restores the model"


def run_alone(loop: FluxLoop, cache: RowCache, spec: SequenceSpec) -> np.ndarray:
    return denoised_alone(loop, cache, spec, first_pixels)


def first_pixels(decoded: torch.Tensor) -> np.ndarray:
    return pixels(decoded.numpy())[0]


@pytest.mark.parametrize("cache", [RowCache, DualBlockCache], indirect=True, ids=["first_block", "dual_block"])
def test_rows_of_a_step_batch_cache_apart(pipeline: FluxPipeline, cache: RowCache) -> None:
    """Image 0 starts alone; image 1 joins at step 3; image 2 joins at step 5 with caching off. Each
    equals its image denoised alone (and the uncached one the plain image), with the First Block
    Cache and with the Dual Block Cache (F1B1, whose back block runs for every row)."""
    loop = FluxLoop(pipeline, torch.device("cpu"))
    specs = [SequenceSpec(PROMPTS[0], "", SIZE, SIZE, STEPS, 4.0, 0, ()),
             SequenceSpec(PROMPTS[1], "", SIZE, SIZE, STEPS, 1.0, 1, ()),
             SequenceSpec(PROMPTS[2], "", SIZE, SIZE, STEPS, 4.0, 2, (), cache_threshold=0.0)]
    with torch.inference_mode():
        alone = [run_alone(loop, cache, spec) for spec in specs]
        plain = [run_alone(loop, cache, SequenceSpec(PROMPTS[2], "", SIZE, SIZE, STEPS, 4.0, 2, ()))]
        skipped_before = cache.rows_skipped
        finished = denoised_joining(loop, cache, specs[0], {3: specs[1], 5: specs[2]}, first_pixels)
    assert cache.rows_skipped > skipped_before
    assert max(largest_difference(finished[index], alone[index]) for index in range(3)) <= 2
    assert largest_difference(alone[2], plain[0]) > 0, "the model's threshold changes image 2"
    with torch.inference_mode():
        uncached = SequenceSpec(PROMPTS[2], "", SIZE, SIZE, STEPS, 4.0, 2, (), cache_threshold=0.0)
        assert largest_difference(run_alone(loop, cache, uncached), call(pipeline, 2, 4.0)) <= 2


def test_states_are_kept_for_the_running_rows_only(pipeline: FluxPipeline, cache: RowCache) -> None:
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


def test_only_described_transformers_are_supported(pipeline: FluxPipeline) -> None:
    assert RowCache.supports(pipeline.transformer)
    assert not RowCache.supports(pipeline.vae)
    with pytest.raises(ValueError, match="no transformer blocks"):
        RowCache(pipeline.vae, THRESHOLD, 0)
