"""The per-row Dual Block Cache (cache-dit's DBCache: Fn front blocks decide, Bn back blocks always
run) on the trained shapes model (a Flux transformer of 6 blocks), in process: one image caches
exactly as cache-dit's own DBCache at the same Fn, Bn and threshold (the First Block Cache as its
F1B0); a model with too few blocks is not offered it. Inside a step-level batch every image keeps its
own decisions, also one that joins late or turns caching off: tests/test_row_cache.py, which runs its
step-batch test with both caches."""

from __future__ import annotations

from collections.abc import Iterator

import cache_dit
import grpc
import numpy as np
import pytest
import torch
from cache_dit import DBCacheConfig
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from runner_service.acceleration.apply import accelerate, offer
from runner_service.acceleration.row_cache import DUAL_BACK_BLOCKS, DUAL_FRONT_BLOCKS, DualBlockCache, RowCache
from runner_service.denoising.loop import max_sequence_length
from runner_service.models.catalog import ensure_builtin
from runner_service.platforms import select_platform
from serving_common.errors import ServiceError
from serving_common.input_rules import DUAL_BLOCK_CACHE, AccelerationPlan

pytestmark = pytest.mark.unit

SIZE, STEPS, THRESHOLD = 64, 10, 0.2
PROMPTS = ["a red circle on a blue background", "a green square at the top left on a white background",
           "a yellow triangle at the bottom right on a black background"]


def shapes() -> FluxPipeline:
    loaded = FluxPipeline.from_pretrained(ensure_builtin("shapes"), dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.fixture(scope="module")
def pipeline() -> FluxPipeline:
    return shapes()


@pytest.fixture
def cache(pipeline: FluxPipeline) -> Iterator[RowCache]:
    attached = DualBlockCache(pipeline.transformer, THRESHOLD, 0)
    yield attached
    attached.remove()


def pixels(images: np.ndarray) -> np.ndarray:
    return np.asarray((images * 255).round().clip(0, 255).astype(np.uint8))


def call(pipeline: FluxPipeline, guidance: float) -> np.ndarray:
    """Image 0 through the pipeline's own ``__call__``, as the runner calls it."""
    with torch.inference_mode():
        images = pipeline(prompt=PROMPTS[0], negative_prompt="", true_cfg_scale=guidance, width=SIZE, height=SIZE,
                          num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="np",
                          **max_sequence_length(pipeline)).images
    return pixels(images)[0]


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def cache_dits_image(front: int, back: int, guidance: float) -> np.ndarray:
    """Image 0 with cache-dit's DBCache on a pipeline of its own (it patches the transformer's
    forward). FluxPipeline's true CFG calls the transformer twice a step, the conditional branch
    first: ``enable_separate_cfg`` keeps the branches' steps and buffers apart, as the rows are here.
    cache-dit wraps the pipeline's class ``__call__``, every instance's: it is disabled before
    returning, which restores the class."""
    reference = shapes()
    cache_dit.enable_cache(reference, cache_config=DBCacheConfig(
        Fn_compute_blocks=front, Bn_compute_blocks=back, residual_diff_threshold=THRESHOLD, max_warmup_steps=0,
        enable_separate_cfg=guidance > 1))
    try:
        return call(reference, guidance)
    finally:
        cache_dit.disable_cache(reference)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["unguided", "true-cfg"])
@pytest.mark.parametrize(("front", "back"), [(1, 0), (DUAL_FRONT_BLOCKS, DUAL_BACK_BLOCKS), (2, 2)],
                         ids=lambda split: str(split))
def test_one_image_caches_as_cache_dit(pipeline: FluxPipeline, front: int, back: int, guidance: float) -> None:
    expected = cache_dits_image(front, back, guidance)
    plain = call(pipeline, guidance)
    cache = RowCache(pipeline.transformer, THRESHOLD, 0, front_blocks=front, back_blocks=back)
    try:
        with cache.pipeline_call([THRESHOLD], STEPS):
            cached = call(pipeline, guidance)
    finally:
        cache.remove()
    assert cache.rows_skipped > 0, "the threshold skips some steps on this image"
    assert largest_difference(expected, cached) == 0
    assert largest_difference(plain, cached) > 0
    assert largest_difference(plain, call(pipeline, guidance)) == 0, "removing the cache restores the model"


def test_a_model_with_too_few_blocks_is_not_offered_it() -> None:
    """tiny-flux has 2 transformer blocks: one front, one back and no middle one to skip."""
    tiny = FluxPipeline.from_pretrained(ensure_builtin("tiny-flux"), dtype=torch.float32)
    assert RowCache.supports(tiny.transformer) and not DualBlockCache.supports(tiny.transformer)
    assert DUAL_BLOCK_CACHE not in offer(tiny, select_platform("cpu")).cache_methods
    with pytest.raises(ServiceError) as refused:
        accelerate(tiny, AccelerationPlan(cache=DUAL_BLOCK_CACHE, cache_threshold=THRESHOLD), select_platform("cpu"))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in refused.value.violations] == ["acceleration.cache"]
    with pytest.raises(ValueError, match="2 transformer blocks: too few"):
        DualBlockCache(tiny.transformer, THRESHOLD, 0)
