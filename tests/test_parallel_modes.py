"""Each parallel mode on two real gloo ranks gives the single-device image (issue 27).

Both ranks build the same tiny pipeline (seeded weights), apply a plan and generate with the same
seed; rank 0's image is compared with the one this process makes on one device. One group of two
processes runs every case in turn, both forked from one forkserver that has imported this module
(torch, diffusers), so the imports are paid once for both.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffusion.v1 import common_pb2
from harness.processes import free_port
from runner_service.families import FAMILIES
from runner_service.parallel import ParallelPlan, apply, check

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

# name: (family, plan, guided, pipeline call arguments). Sizes are the smallest whose image tokens
# split evenly over two ranks; two steps.
CASES: dict[str, tuple[str, ParallelPlan, bool, dict[str, Any]]] = {
    "flux-ulysses": ("flux", ParallelPlan(ulysses_degree=2), False, {"height": 32, "width": 32}),
    "flux-cfg": (
        "flux", ParallelPlan(cfg=True), True,
        {"height": 32, "width": 32, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    ),
    "qwen-image-cfg": (
        "qwen-image", ParallelPlan(cfg=True), True,
        {"height": 32, "width": 32, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    ),
    "sd3-cfg": ("sd3", ParallelPlan(cfg=True), True, {"height": 8, "width": 8, "guidance_scale": 5.0}),
    # The UNet families (issue 41 item 6): their rows split as SD3's.
    "sd-cfg": ("sd", ParallelPlan(cfg=True), True, {"height": 32, "width": 32, "guidance_scale": 5.0}),
    "sdxl-cfg": ("sdxl", ParallelPlan(cfg=True), True, {"height": 16, "width": 16, "guidance_scale": 5.0}),
    "wan-ulysses": (
        "wan", ParallelPlan(ulysses_degree=2), False,
        {"height": 16, "width": 16, "num_frames": 5, "guidance_scale": 1.0},
    ),
    # The tiny Wan's branches differ so little that guidance 5 moves its frames by 0.007/255, which
    # would hide swapped branches; at 2000 guidance moves them by 23/255.
    "wan-cfg": (
        "wan", ParallelPlan(cfg=True), True,
        {"height": 16, "width": 16, "num_frames": 5, "guidance_scale": 2000.0, "negative_prompt": "blurry"},
    ),
}


def _generate(name: str, rank_plan: ParallelPlan | None) -> tuple[np.ndarray, int]:
    """The case's image (or frames) on this process, with the number of values of ``hidden_states``
    the first self-attention was handed over the whole generation (a rank's share of the
    denoising work); with ``rank_plan``, as one rank of the group."""
    family, _, guided, arguments = CASES[name]
    torch.manual_seed(0)
    pipeline = FAMILIES[family].build()
    pipeline.set_progress_bar_config(disable=True)
    seen = [0]

    def count(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen[0] += (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).numel()

    if hasattr(pipeline, "unet"):  # its first self-attention
        attention = next(module for name, module in pipeline.unet.named_modules() if name.endswith("attn1"))
    else:
        transformer = pipeline.transformer
        blocks = transformer.transformer_blocks if hasattr(transformer, "transformer_blocks") else transformer.blocks
        first_block = blocks[0]
        # its self-attention: Wan's context-parallel plan splits the sequence at the block's own input
        attention = first_block.attn1 if hasattr(first_block, "attn1") else first_block.attn
    attention.register_forward_pre_hook(count, with_kwargs=True)
    split = apply(rank_plan, pipeline, torch.device("cpu")) if rank_plan is not None else None
    call = dict(prompt="a red circle", num_inference_steps=2, output_type="np", return_dict=False,
                generator=torch.Generator().manual_seed(7), **arguments)
    generate: Callable[..., tuple[Any, ...]] = pipeline.__call__  # a family pipeline's own __call__
    if split is None:
        return np.asarray(generate(**call)[0]), seen[0]
    with split.request(guided):
        return np.asarray(generate(**call)[0]), seen[0]


def _rank(rank: int, port: int, results: Any) -> None:
    """One rank: every case in order (each builds its own meshes), reporting its image and work."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        for name, (_, plan, _, _) in CASES.items():
            results.put((name, rank, *_generate(name, plan)))
    except Exception:
        results.put(("error", rank, traceback.format_exc(), 0))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group_results() -> dict[tuple[str, int], tuple[np.ndarray, int]]:
    """(case, rank): the rank's image and work, from one group of two gloo ranks."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # where this test process has not started it already
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    reported: dict[tuple[str, int], tuple[np.ndarray, int]] = {}
    try:
        while len(reported) < 2 * len(CASES):
            name, rank, image, work = results.get(timeout=240)
            if name == "error":
                pytest.fail(f"rank {rank}: {image}")
            reported[name, rank] = (image, work)
    except queue.Empty:
        pytest.fail(f"the group reported {sorted(reported)} of {sorted(CASES)} on both ranks within 240 s")
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    return reported


@pytest.mark.parametrize("name", list(CASES))
def test_mode_equals_single_device(
    name: str, group_results: dict[tuple[str, int], tuple[np.ndarray, int]]
) -> None:
    reference, work = _generate(name, None)
    assert float(reference.std()) > 0  # a blank image would match anything blank
    for rank in range(2):
        image, rank_work = group_results[name, rank]
        assert image.shape == reference.shape
        assert float(np.abs(image - reference).max()) * 255 <= 2, rank
        # each rank did half the denoiser's work: half the calls, rows or sequence
        assert rank_work * 2 == work, (rank, rank_work, work)


def test_plan_reads_zero_degrees_as_none() -> None:
    plan = ParallelPlan.from_proto(common_pb2.Parallelism(cfg=True))
    assert plan == ParallelPlan(cfg=True, ulysses_degree=1, ring_degree=1)
    assert plan.world_size == 2
    assert ParallelPlan.from_proto(plan.to_proto()) == plan


@pytest.mark.parametrize(("family", "plan", "world_size", "field"), [
    # PixArt's transformer learns its variance: no CFG layout is declared for it
    ("pixart-alpha", ParallelPlan(cfg=True), 2, "parallel.cfg"),
    # a UNet has no context-parallel plan in diffusers
    ("sd", ParallelPlan(ulysses_degree=2), 2, "parallel.ulysses_degree"),
    # the tiny Flux transformer has 2 heads
    ("flux", ParallelPlan(ulysses_degree=4), 4, "parallel.ulysses_degree"),
    ("flux", ParallelPlan(cfg=True, ulysses_degree=2), 2, "parallel.ulysses_degree 2 x parallel.ring_degree 1 x 2"),
    ("flux", ParallelPlan(ulysses_degree=2), 3, "parallel.ulysses_degree 2 x parallel.ring_degree 1 = 2 ranks"),
    # diffusers' ring attention wants the log-sum-exp, which the native (CPU) backend does not return
    ("flux", ParallelPlan(ring_degree=2), 2, "parallel.ring_degree"),
])
def test_refusals_name_the_field(family: str, plan: ParallelPlan, world_size: int, field: str) -> None:
    violations = check(plan, FAMILIES[family].build(), world_size)
    assert len(violations) == 1
    assert violations[0].startswith(field), violations
