"""FLUX.1-dev's transformer at its full size, with random weights, denoising one 1024 x 1024 image in
28 steps on 1, 2 and 4 devices with Ulysses context parallelism: what a runner group (issue 27)
gains per image, and whether its image stays the one-device image.

    python -m benchmarks.flux_group                     # CUDA, bf16, full size, 1 2 4 devices
    python -m benchmarks.flux_group --device cpu --dtype float32 --layers 1 1 --heads 2 --size 128 \\
        --steps 2 --text-tokens 16 --degrees 1 2         # a toy smoke run on two gloo ranks

Each degree N is a fresh group of N processes, forked from one ``torch.multiprocessing`` forkserver
that has imported this module (a fresh interpreter that touches no device), joined with the
device's ``torch.distributed`` backend (``runner_service.platforms.distributed_backend``: nccl on
CUDA, gloo on the CPU), rank i on ``cuda:i``. Every rank builds the same transformer as
``benchmarks.flux_full`` does (same seed, so the same random weights) and the runner's own
``runner_service.parallel.apply`` splits it with ``ParallelPlan(ulysses_degree=N)`` (diffusers'
``ContextParallelConfig`` through ``enable_parallelism``); 1 device is the same code with nothing
split. The timed loop is ``flux_full``'s (transformer call and Euler step per step, no text encoders,
no VAE); the figure is the slowest rank's fastest of ``--repeats`` loops after a first loop, whose
result is compared with the one-device result (the largest absolute difference).

A degree needs that many CUDA devices; when fewer are visible it is not measured and the output says
so ("2 devices: only 1 CUDA device visible"). Writes ``benchmarks/results/flux_group.json`` and
prints a table; exits 1 when a degree failed or none could be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import start_processes

from benchmarks.bench import RESULTS
from benchmarks.flux_full import Inputs, add_configuration_arguments, build_pipeline, denoise, flux_config, timed
from harness.processes import free_port
from runner_service.parallel import ParallelPlan, apply
from runner_service.platforms import distributed_backend, select_platform

DEGREES = (1, 2, 4)
# How long a rank waits for the others to join and in each exchange: the full-size transformer takes
# a minute or two to build on a rank.
GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Setup:
    """What every rank needs to build and time the same model (picklable: it crosses to the ranks)."""

    device: str
    dtype: str
    config: dict[str, Any]
    size: int
    text_tokens: int
    steps: int
    repeats: int


@dataclass
class Measured:
    devices: int
    seconds: float
    first_s: float
    max_abs_difference: float | None = None


def rank_device(kind: str, rank: int) -> str:
    """Rank ``rank``'s device: its own accelerator, or the shared host."""
    return "cpu" if kind == "cpu" else f"{kind}:{rank}"


def _rank(rank: int, world_size: int, port: int, setup: Setup, results: Any) -> None:
    """One rank: joins the group, builds and splits the transformer, times it; rank 0 reports the
    slowest rank's figures and its latents. A rank's exception reaches ``measure`` through
    ``torch.multiprocessing.start_processes``, traceback included."""
    device = rank_device(setup.device, rank)
    platform = select_platform(device)  # binds the rank's accelerator before its communicator is made
    if platform.name == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(distributed_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT,
                            device_id=None if platform.name == "cpu" else platform.device)
    try:
        dtype = getattr(torch, setup.dtype)
        pipeline = build_pipeline(setup.config, platform.device, dtype, seed=0)
        apply(ParallelPlan(ulysses_degree=world_size), pipeline, platform.device)
        inputs = Inputs.random(setup.config, setup.size, setup.text_tokens, platform.device, dtype, seed=0)
        dist.barrier()
        platform.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            latents = denoise(pipeline.transformer, inputs, setup.steps)
        platform.synchronize()
        first = time.perf_counter() - start
        loops = []
        for _ in range(setup.repeats):
            dist.barrier()  # the ranks start each loop together: their exchanges wait for the slowest
            loops.append(timed(pipeline, None, inputs, setup.steps, platform))
        slowest = torch.tensor([min(loops), first], dtype=torch.float64, device=platform.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:  # by value: a shared tensor would not outlive this process
            results.put((*slowest.tolist(), latents.float().cpu().numpy()))
    finally:
        dist.destroy_process_group()


def measure(setup: Setup, world_size: int) -> tuple[Measured, np.ndarray]:
    """One group of ``world_size`` ranks: the slowest rank's figures and rank 0's latents."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["benchmarks.flux_group"])  # where this process has not started it already
    results = context.SimpleQueue()
    start_processes(_rank, args=(world_size, free_port(), setup, results), nprocs=world_size,  # type: ignore[no-untyped-call]
                    start_method="forkserver")
    seconds, first, latents = results.get()
    return Measured(world_size, seconds, first), latents


def unmeasurable(kind: str, devices: int) -> str | None:
    """Why a group of ``devices`` cannot be measured here, or None: an accelerator group needs that
    many devices visible (CPU ranks share the host)."""
    if kind != "cuda":
        return None
    visible = torch.cuda.device_count()
    if visible >= devices:
        return None
    return f"{count(devices)}: only {count(visible, 'CUDA device')} visible"


def count(number: int, noun: str = "device") -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def table(measured: list[Measured], notes: list[str]) -> str:
    rows = ["| devices | seconds per image | first loop s | speed-up | max abs difference from 1 device |",
            "|---|---|---|---|---|"]
    one = next((result.seconds for result in measured if result.devices == 1), None)
    for result in measured:
        speedup = "" if one is None else f"{one / result.seconds:.2f}x"
        difference = "" if result.max_abs_difference is None else f"{result.max_abs_difference:.3g}"
        rows.append(f"| {result.devices} | {result.seconds:.3f} | {result.first_s:.2f} | {speedup} | {difference} |")
    return "\n".join([*rows, *notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the device kind of every rank")
    add_configuration_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed loops after the first")
    parser.add_argument("--degrees", type=int, nargs="+", default=list(DEGREES), help="group sizes (Ulysses degrees)")
    parser.add_argument("--output", type=Path, default=RESULTS / "flux_group.json")
    arguments = parser.parse_args(argv)
    config = flux_config(arguments.layers[0], arguments.layers[1], arguments.heads)
    setup = Setup(arguments.device, arguments.dtype, config, arguments.size, arguments.text_tokens,
                  arguments.steps, arguments.repeats)
    measured: list[Measured] = []
    notes: list[str] = []
    failed = False
    reference: np.ndarray | None = None
    for devices in sorted(set(arguments.degrees)):
        reason = unmeasurable(arguments.device, devices)
        if reason is not None:
            notes.append(reason)
            print(reason, flush=True)
            continue
        try:
            result, latents = measure(setup, devices)
        except Exception as error:  # one degree failing is reported; the others still run
            failed = True
            notes.append(f"{count(devices)}: failed: {error}")
            print(notes[-1], file=sys.stderr, flush=True)
            continue
        if devices == 1:
            reference = latents
        elif reference is not None:
            result.max_abs_difference = float(np.abs(latents - reference).max())
        measured.append(result)
        print(f"{count(devices)}: {result.seconds:.3f} s (first loop {result.first_s:.3f} s)", flush=True)
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps({
        "config": {**{name: str(value) if isinstance(value, Path) else value
                      for name, value in vars(arguments).items()},
                   "transformer": config, "torch": torch.__version__},
        "measured": [asdict(result) for result in measured], "notes": notes, "failed": failed}, indent=2))
    print(table(measured, notes))
    return 1 if failed or not measured else 0


if __name__ == "__main__":
    sys.exit(main())
