"""DeepCache per row on a UNet (``deep_cache``), on the tiny Stable Diffusion model: one request
equals the ``DeepCache`` package's own helper bit for bit; inside a step batch every image keeps its
own schedule and features, also one that joins late, one at another interval and one with caching
off (exactly the plain image); the interval rule at Init and per request; served by a real runner."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from DeepCache import DeepCacheSDHelper
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline

from diffusion.v1 import common_pb2, runner_pb2_grpc
from fixtures_runner import SharedRunner
from runner_calls import execute, info, item, load, pixels, runner_stub
from runner_service.acceleration.unet_cache import DEFAULT_BRANCH, UNetCache
from runner_service.denoising.loop import SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families.sd.loop import StableDiffusionLoop
from runner_service.families.sdxl.loop import StableDiffusionXLLoop
from runner_service.models.catalog import ensure_builtin
from serving_common.input_rules import (
    CACHE_DEFAULTS,
    DEEP_CACHE,
    acceleration_violations,
    cache_threshold_problem,
    with_cache_defaults,
)
from step_batches import denoised_alone, denoised_joining

SIZE, STEPS, INTERVAL = 64, 10, 3
PROMPTS = ["a red fox", "a lighthouse at dusk", "a bowl of fruit"]


@pytest.fixture(scope="module")
def pipeline() -> StableDiffusionPipeline:
    loaded = StableDiffusionPipeline.from_pretrained(ensure_builtin("tiny"), dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.fixture(scope="module")
def sdxl() -> StableDiffusionXLPipeline:
    """``tiny-sdxl``: two layers a level, so a branch can sit between the first level's layers."""
    loaded = StableDiffusionXLPipeline.from_pretrained(ensure_builtin("tiny-sdxl"), dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


@pytest.fixture
def cache(pipeline: StableDiffusionPipeline) -> Iterator[UNetCache]:
    attached = UNetCache(pipeline.unet, INTERVAL, 0)
    yield attached
    attached.remove()


def to_pixels(images: object) -> np.ndarray:
    return np.asarray((np.asarray(images) * 255).round().clip(0, 255).astype(np.uint8))


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def call(pipeline: StableDiffusionPipeline | StableDiffusionXLPipeline) -> np.ndarray:
    """Two images by the pipeline's own ``__call__`` (guided: four UNet rows a step)."""
    with torch.inference_mode():
        images = pipeline(PROMPTS[:2], num_inference_steps=STEPS, width=SIZE, height=SIZE, output_type="np",
                          generator=[torch.Generator().manual_seed(index) for index in range(2)]).images
    return to_pixels(images)


@pytest.mark.unit
@pytest.mark.parametrize(("model", "branch"), [("pipeline", 0), ("pipeline", 1), ("sdxl", 1)],
                         ids=["tiny, branch 0 (the default)", "tiny, branch 1 (its last first-level layer)",
                              "tiny-sdxl, branch 1 (between its first level's two layers)"])
def test_one_request_caches_as_the_deepcache_package(request: pytest.FixtureRequest, model: str, branch: int) -> None:
    """The package's helper at the same branch, uniform, is the reference: at the first level's last
    layer, at its first (the cached step runs only the last up layer there) and between."""
    pipeline: StableDiffusionPipeline | StableDiffusionXLPipeline = request.getfixturevalue(model)
    assert DEFAULT_BRANCH == 0
    helper = DeepCacheSDHelper(pipe=pipeline)
    helper.set_params(cache_interval=INTERVAL, cache_branch_id=branch)
    helper.enable()
    try:
        expected = call(pipeline)
    finally:
        helper.disable()
    plain = call(pipeline)
    cache = UNetCache(pipeline.unet, INTERVAL, 0, branch)
    try:
        with cache.pipeline_call([INTERVAL, INTERVAL], STEPS):
            cached = call(pipeline)
    finally:
        cache.remove()
    # Steps 0, 3, 6 and 9 of 10 run in full: 6 of every row's 10 reuse.
    assert (cache.rows_run, cache.rows_skipped) == (4 * STEPS, 4 * 6)
    assert largest_difference(expected, cached) == 0
    assert largest_difference(plain, cached) > 0
    assert largest_difference(plain, call(pipeline)) == 0, "removing the cache restores the model"


def spec(index: int, guidance: float = 7.5, **fields: float) -> SequenceSpec:
    return SequenceSpec(PROMPTS[index], "", SIZE, SIZE, STEPS, guidance, index, (), **fields)  # type: ignore[arg-type]


def run_alone(loop: StableDiffusionLoop, cache: UNetCache | None, wanted: SequenceSpec) -> np.ndarray:
    return denoised_alone(loop, cache, wanted, first_pixels)


def first_pixels(decoded: torch.Tensor) -> np.ndarray:
    return to_pixels(decoded)[0]


@pytest.mark.unit
def test_rows_of_a_step_batch_cache_apart(pipeline: StableDiffusionPipeline, cache: UNetCache) -> None:
    """Image 0 starts alone at the model's interval; image 1 (unguided, interval 2) joins at step 3,
    image 2 (caching off) at step 5. Each is within 2/255 of its image denoised alone with the same
    setting, and image 2 alone is exactly the plain model's."""
    loop = StableDiffusionLoop(pipeline, torch.device("cpu"))
    specs = [spec(0), spec(1, guidance=1.0, cache_threshold=2), spec(2, cache_threshold=0)]
    with torch.inference_mode():
        alone = [run_alone(loop, cache, wanted) for wanted in specs]
        plain = [run_alone(loop, None, wanted) for wanted in specs]
        skipped_before = cache.rows_skipped
        finished = denoised_joining(loop, cache, specs[0], {3: specs[1], 5: specs[2]}, first_pixels)
    assert cache.rows_skipped > skipped_before
    assert max(largest_difference(finished[index], alone[index]) for index in range(3)) <= 2
    assert largest_difference(alone[2], plain[2]) == 0, "caching off is the plain model"
    assert min(largest_difference(alone[index], plain[index]) for index in range(2)) > 2, "the cache changes 0, 1"


@pytest.mark.unit
def test_a_late_joiner_never_reads_another_rows_features(pipeline: StableDiffusionPipeline,
                                                        cache: UNetCache) -> None:
    """A sequence joining while the others reuse runs its first step in full, and the rows of the
    finished sequences are dropped with their features."""
    loop = StableDiffusionLoop(pipeline, torch.device("cpu"))
    with torch.inference_mode():
        first = loop.start(spec(0), PromptCache(0), "")
        loop.step([first], cache)
        skipped = cache.rows_skipped
        second = loop.start(spec(1, guidance=1.0), PromptCache(0), "")
        loop.step([first, second], cache)  # the first's step 1 reuses; the joiner's step 0 cannot
        assert (cache.rows_run, cache.rows_skipped - skipped) == (2 + 3, 2)
        while not first.finished:
            loop.step([first, second], cache)
        loop.step([second], cache)
    assert cache.live_rows == 1, "the finished guided sequence's two rows were dropped"


@pytest.mark.unit
def test_sdxl_caches_through_its_loop(sdxl: StableDiffusionXLPipeline) -> None:
    """SDXL's UNet (its added conditions beside the text) caches by the same hooks."""
    loop = StableDiffusionXLLoop(sdxl, torch.device("cpu"))
    cache = UNetCache(sdxl.unet, INTERVAL, 0)
    try:
        with torch.inference_mode():
            cached = run_alone(loop, cache, spec(0, guidance=5.0))
            off = run_alone(loop, cache, spec(0, guidance=5.0, cache_threshold=0))
            plain = run_alone(loop, None, spec(0, guidance=5.0))
    finally:
        cache.remove()
    assert cache.rows_skipped == 2 * 6, "steps 1, 2, 4, 5, 7 and 8 of the cached image reuse"
    assert largest_difference(off, plain) == 0
    assert largest_difference(cached, plain) > 0


@pytest.mark.unit
def test_only_conditional_unets_are_supported(pipeline: StableDiffusionPipeline) -> None:
    assert UNetCache.supports(pipeline.unet)
    assert not UNetCache.supports(pipeline.vae)
    with pytest.raises(ValueError, match="not a UNet"):
        UNetCache(pipeline.vae, INTERVAL, 0)
    with pytest.raises(ValueError, match="branch 2 is not one of the first level's 0 to 1 layers"):
        UNetCache(pipeline.unet, INTERVAL, 0, branch=2)


@pytest.mark.unit
def test_the_interval_is_a_whole_number_of_steps() -> None:
    default = CACHE_DEFAULTS[DEEP_CACHE]
    assert with_cache_defaults(common_pb2.Acceleration(cache=DEEP_CACHE)) == common_pb2.Acceleration(
        cache=DEEP_CACHE, cache_threshold=default.threshold, cache_warmup_steps=default.warmup_steps)
    assert default.threshold == int(default.threshold)
    assert acceleration_violations(common_pb2.Acceleration(cache=DEEP_CACHE, cache_threshold=2.5)) == [
        ("acceleration.cache_threshold", "deep_cache's threshold is its interval, a whole number of steps, got 2.5")]
    assert acceleration_violations(common_pb2.Acceleration(cache=DEEP_CACHE, cache_threshold=4)) == []
    assert cache_threshold_problem(2.5, DEEP_CACHE) == (
        "deep_cache's threshold is its interval, a whole number of steps, got 2.5")
    assert cache_threshold_problem(2, DEEP_CACHE) is None and cache_threshold_problem(0, DEEP_CACHE) is None
    assert cache_threshold_problem(0.25, "first_block_cache") is None


@pytest.fixture(scope="module")
def served(shared_runner: SharedRunner) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    """The shared runner with ``tiny`` loaded with ``deep_cache`` alone (its default interval)."""
    stub = runner_stub(shared_runner.target)
    loaded = load(stub, "tiny", cache=DEEP_CACHE)
    default = CACHE_DEFAULTS[DEEP_CACHE]
    assert loaded.model.acceleration == common_pb2.Acceleration(
        cache=DEEP_CACHE, cache_threshold=default.threshold, cache_warmup_steps=default.warmup_steps)
    assert list(loaded.model.acceleration_offer.cache_methods) == [DEEP_CACHE]
    yield stub
    load(stub, "tiny")


@pytest.mark.process
@pytest.mark.timeout(300)
def test_served_requests_cache_at_their_own_interval(served: runner_pb2_grpc.RunnerServiceStub,
                                                     pipeline: StableDiffusionPipeline) -> None:
    """Requests at the model's interval, at their own and with caching off, one after another."""
    default = CACHE_DEFAULTS[DEEP_CACHE]
    loop = StableDiffusionLoop(pipeline, torch.device("cpu"))
    cache = UNetCache(pipeline.unet, default.threshold, default.warmup_steps)
    try:
        with torch.inference_mode():
            expected = {threshold: run_alone(loop, cache, SequenceSpec(
                "a red fox", "", SIZE, SIZE, STEPS, 7.5, 1, (), cache_threshold=threshold))
                for threshold in (None, 2.0, 0.0)}
            plain = run_alone(loop, None, SequenceSpec("a red fox", "", SIZE, SIZE, STEPS, 7.5, 1, ()))
    finally:
        cache.remove()
    skipped = info(served).cache.skipped_rows
    for threshold, wanted in expected.items():
        fields = {} if threshold is None else {"cache_threshold": threshold}
        image = pixels(execute(served, item(seed=1, steps=STEPS, size=SIZE, **fields))[1])
        assert largest_difference(image, wanted) <= 2, threshold
    assert largest_difference(expected[0.0], plain) == 0
    assert largest_difference(expected[None], plain) > 0, "the default interval changes the image"
    assert info(served).cache.skipped_rows > skipped
    with pytest.raises(grpc.RpcError) as refused:
        execute(served, item(seed=1, steps=STEPS, size=SIZE, cache_threshold=2.5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_threshold" in (refused.value.details() or "")
