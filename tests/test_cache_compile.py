"""The step cache with compile, in process on the trained shapes model, compiled once for the
module (the load's compile is most of its time; a second compiled load of the same blocks in one
process compiles nothing): after the load's warm-up, a step batch whose rows join, leave and
skip at different steps compiles nothing more (dynamo's own graph counter, issue 41 item 4), and
served requests, with and without the cache, through a level-1 sleep and a weights change, draw
as the same model with the cache and no compile within 2/255. The First Block Cache is compiled
first; TaylorSeer, loaded last with compile, reuses its graphs (a few seconds) and is held to the
same: no graph compiled while serving its own mixed step batch."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

from diffusion.v1 import runner_pb2
from runner_calls import SHAPES_ITEM, item
from runner_service.acceleration.compiled_blocks import padded
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.denoising.loop import DenoisingLoop, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.device_gate import CallWatch
from runner_service.execution import BatchResult, ImageOutput
from runner_service.loaded_model import LoadedModel
from runner_service.models.catalog import SHIPPED_MODELS
from serving_common.input_rules import FIRST_BLOCK_CACHE, TAYLORSEER, AccelerationPlan

pytestmark = [pytest.mark.timeout(900), pytest.mark.process, pytest.mark.slow]

SIZE = 64
CACHED = AccelerationPlan(cache=FIRST_BLOCK_CACHE, cache_threshold=0.2)
# By the step each joins: a guided image; an unguided one (a single row, so one computing row
# among several); one that never caches and leaves early; one that skips at a threshold of its own.
JOINING = {
    0: SequenceSpec("a red circle on a blue background", "", SIZE, SIZE, 8, 4.0, 0, ()),
    2: SequenceSpec("a green square at the top left on a white background", "", SIZE, SIZE, 7, 1.0, 1, ()),
    3: SequenceSpec("a yellow triangle at the bottom right on a black background", "", SIZE, SIZE, 3, 4.0, 2, (),
                    cache_threshold=0.0),
    4: SequenceSpec("a blue circle on a white background", "", SIZE, SIZE, 6, 4.0, 3, (), cache_threshold=0.4),
}
# TaylorSeer computing every other step after its first (the model's interval 2, warmup 1: steps 0,
# 2, 4, ...) and each row's last step, by the step each joins: a guided image of 6 steps (its last,
# 5, off the interval, computes by the last-step rule); an unguided one of 5 whose single row
# computes alone among three rows, then among five; one that never predicts (interval 0); one at an
# interval of its own (3: steps 0, 2, 5, ...) of 5 steps, whose step 3 is a call in which every row
# predicts and whose last, 4, computes by the rule. By the batch's step, each image's step (A to D
# as they join) and whether its rows compute (c) or predict (p): 0: A0c; 1: A1p B0c; 2: A2c B1p C0c;
# 3: A3p B2c C1c; 4: A4c B3p D0c; 5: A5c (last) B4c D1p; 6: D2c; 7: D3p; 8: D4c (last). Its calls:
# 2 rows (2 computing), 3 (1), 5 (4), 5 (3), 5 (4), 5 (3), 2 (2), 2 (0), 2 (2): 31 rows, 10 skipped.
TAYLORSEER_CACHED = AccelerationPlan(cache=TAYLORSEER, cache_threshold=2, cache_warmup_steps=1)
TAYLORSEER_JOINING = {
    0: SequenceSpec("a red circle on a blue background", "", SIZE, SIZE, 6, 4.0, 0, ()),
    1: SequenceSpec("a green square at the top left on a white background", "", SIZE, SIZE, 5, 1.0, 1, ()),
    2: SequenceSpec("a yellow triangle at the bottom right on a black background", "", SIZE, SIZE, 2, 4.0, 2, (),
                    cache_threshold=0.0),
    4: SequenceSpec("a blue circle on a white background", "", SIZE, SIZE, 5, 4.0, 3, (), cache_threshold=3),
}
# Served requests: at the model's threshold, with the cache off (threshold 0), and at 128 x 128.
REQUESTS = [item(seed=3, **SHAPES_ITEM), item(seed=4, cache_threshold=0.0, **SHAPES_ITEM),
            item(seed=5, **{**SHAPES_ITEM, "size": 128})]


@dataclasses.dataclass(frozen=True)
class Eager:
    """The images the model with the cache and no compile draws: ``JOINING``'s by seed, ``REQUESTS``'."""
    mixed: dict[int, np.ndarray]
    served: list[np.ndarray]


@pytest.fixture(scope="module")
def host(cpu_platform) -> Iterator[ModelHost]:
    yield ModelHost(cpu_platform, RunnerConfig())


@pytest.fixture(scope="module")
def eager(host: ModelHost) -> Eager:
    model = loaded(host, CACHED)
    return Eager(mixed_run(model), [served(host, request) for request in REQUESTS])


@pytest.fixture(scope="module")
def compiled(host: ModelHost, eager: Eager) -> LoadedModel:
    """The same model with compile, loaded once the eager images are drawn."""
    model = loaded(host, dataclasses.replace(CACHED, compile=True))
    assert model.acceleration.compile
    return model


def loaded(host: ModelHost, plan: AccelerationPlan) -> LoadedModel:
    asyncio.run(host.load("shapes", None, plan=plan))
    assert host.model is not None and host.model.loop is not None and host.model.row_cache is not None
    return host.model


def mixed_run(model: LoadedModel, joining: dict[int, SequenceSpec] = JOINING) -> dict[int, np.ndarray]:
    """``joining``'s images from one step batch, by seed."""
    loop, cache = model.loop, model.row_cache
    assert isinstance(loop, DenoisingLoop) and cache is not None
    running: list[Sequence] = []
    finished: dict[int, np.ndarray] = {}
    step = 0
    with torch.inference_mode():
        while running or step <= max(joining):
            if step in joining:
                running.append(loop.start(joining[step], PromptCache(0), ""))
            loop.step(running, cache)
            step += 1
            for sequence in [s for s in running if s.finished]:
                image = loop.decode([sequence]).numpy()[0]
                finished[sequence.spec.seed] = (image * 255).round().clip(0, 255).astype(np.uint8)
                running.remove(sequence)
    return finished


def served(host: ModelHost, request: runner_pb2.ExecuteItem) -> np.ndarray:
    """The image of one request executed as the runner's Execute runs it (the step batch)."""
    async def result() -> BatchResult:
        async for event in host.execute([request], progress=False):
            if isinstance(event, BatchResult):
                return event
        raise AssertionError("no result")

    (output,) = asyncio.run(result()).outputs
    assert isinstance(output, ImageOutput)
    return output.pixels


def largest_difference(first: np.ndarray, second: np.ndarray) -> int:
    return int(np.abs(first.astype(np.int16) - second).max())


def test_a_single_computing_row_is_run_as_two() -> None:
    assert padded([3], 4) == [3, 3]
    assert padded([3], 1) == [3], "a call of one row is the call's own batch"
    assert padded([1, 2], 4) == [1, 2]
    assert padded([], 4) == []


def mixed_runs_compile_nothing(compiled: LoadedModel, eager: dict[int, np.ndarray],
                               joining: dict[int, SequenceSpec]) -> tuple[int, int]:
    """Runs ``joining``'s step batch twice on the compiled model: no graph compiled, no recompile
    limit hit, the same images both times and each within 2/255 of ``eager``'s. Returns the rows
    the cache ran and skipped over both runs."""
    cache = compiled.row_cache
    assert cache is not None
    graphs, before = counters["stats"]["unique_graphs"], (cache.rows_run, cache.rows_skipped)
    assert graphs > 0, "the load compiled the blocks"
    mixed = mixed_run(compiled, joining)
    mixed_again = mixed_run(compiled, joining)
    assert counters["stats"]["unique_graphs"] == graphs, "no graph compiled after the warm-up"
    # Past its recompile limit dynamo runs a frame, and what it calls, eagerly: nothing compiles
    # any more, so the count above would hold while the blocks no longer run compiled.
    assert not [message for message in counters["unimplemented"] if "recompile limit" in message]
    assert sorted(mixed) == sorted(eager) == sorted(spec.seed for spec in joining.values())
    differences = {seed: largest_difference(mixed[seed], eager[seed]) for seed in eager}
    assert max(differences.values()) <= 2, differences
    assert all(np.array_equal(mixed[seed], mixed_again[seed]) for seed in mixed)
    return cache.rows_run - before[0], cache.rows_skipped - before[1]


def test_a_mixed_step_batch_compiles_nothing_after_the_warm_up_and_equals_eager(eager: Eager,
                                                                               compiled: LoadedModel) -> None:
    rows, skipped = mixed_runs_compile_nothing(compiled, eager.mixed, JOINING)
    assert 0 < skipped < rows, "some rows skipped, others computed"


def test_served_requests_equal_eager_with_and_without_the_cache_and_follow_the_weights(
        host: ModelHost, eager: Eager, compiled: LoadedModel, tmp_path: Path) -> None:
    """A 64 and a 128 image, one of each with the cache off (threshold 0), equal the eager model's;
    a level-1 sleep changes nothing, and weights loaded change the image until the stored ones
    are loaded back (the compiled blocks read the parameters)."""
    cache = compiled.row_cache
    assert cache is not None
    before = (cache.rows_run, cache.rows_skipped)
    images = [served(host, request) for request in REQUESTS]
    differences = [largest_difference(image, wanted) for image, wanted in zip(images, eager.served, strict=True)]
    assert max(differences) <= 2, differences
    rows, skipped = cache.rows_run - before[0], cache.rows_skipped - before[1]
    assert 0 < skipped < rows

    asyncio.run(host.sleep(1, [], CallWatch("Sleep")))
    asyncio.run(host.wake([], CallWatch("WakeUp")))
    assert np.array_equal(served(host, REQUESTS[0]), images[0])
    stored = load_file(SHIPPED_MODELS["shapes"] / "transformer" / "diffusion_pytorch_model.safetensors")
    original = {"transformer.proj_out.weight": stored["proj_out.weight"].float()}  # as loaded
    for tensors in ({name: tensor * 0.5 for name, tensor in original.items()}, original):
        save_file(tensors, tmp_path / "proj_out.safetensors")
        asyncio.run(host.load_weights(str(tmp_path / "proj_out.safetensors"), "", CallWatch("LoadWeights")))
        assert np.array_equal(served(host, REQUESTS[0]), images[0]) == (tensors is original)


def test_taylorseer_with_compile_compiles_nothing_after_the_warm_up_and_equals_eager(host: ModelHost) -> None:
    """Last in the module: it replaces the compiled First Block Cache model."""
    eager = mixed_run(loaded(host, TAYLORSEER_CACHED), TAYLORSEER_JOINING)
    compiled = loaded(host, dataclasses.replace(TAYLORSEER_CACHED, compile=True))
    assert mixed_runs_compile_nothing(compiled, eager, TAYLORSEER_JOINING) == (2 * 31, 2 * 10)
