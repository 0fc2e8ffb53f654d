"""What serving adds to a request (issue 40): a fixed cost per request and a cost per denoising step.

``python -m benchmarks.bench_overhead [--pairs 15] [--steps 1 200] [--modes step request]`` serves
``--model`` (``tiny``) at ``--size`` (64) x 64 with raw output (no encoding) through a worker and a
runner started with ``--batching MODE``, one server pair at a time, alone while it is measured.
Against it, the same pipeline loaded in this process from the same built-in directory is called
with the same prompt, seed and guidance, asking for the ``output_type`` the runner asks for and
converting to uint8 as the runner does. Each pair is an in-process call then a served one, at
each step count in turn, every pair with a prompt of its own (no prompt cache is flattered).

From the pairs, so that a slow moment of the shared machine falls on both sides of a difference:
the fixed cost per request is the median over pairs of served - in-process at the fewest steps;
the cost per step is the median over pairs of the served run's growth from the fewest steps to the
most, less the in-process run's, over the steps between. Each median comes with its 95% confidence
interval (distribution-free: order statistics of the pairs' differences), so a target is met only
where the interval's upper end is under it. Beside them, the medians of the served results' own ``timings``
(worker: queue, execute, transfer, encode, total; runner: text encode, denoise, decode, to host),
which say where the fixed cost goes, and the transport floor (``benchmarks/grpc_floor.py``: the same two
gRPC calls with nothing behind them, measured first), the least any served request costs. Writes
``benchmarks/results/overhead.json`` and prints a table.
A measurement: it exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch

from benchmarks import grpc_floor
from benchmarks.bench import GUIDANCE, RESULTS, InProcess, new_results, prompt_for, write_results
from clients import DiffusionClient
from clients.types import Timings
from harness.processes import start_runner, start_worker
from runner_service.device_output import as_pixels, channels_last
from runner_service.models.catalog import ensure_builtin
from runner_service.pipeline_adapter import output_type_of

FIXED_TARGET_MS = 1.0
STEP_TARGET_MS = 0.05
FLOOR_CALLS = 300  # requests through the transport floor's two empty hops
WARMUP = 2  # calls of each kind before the pairs: a fresh runner's and pipeline's first runs are slow


class RawInProcess(InProcess):
    """The baseline, asking the pipeline for the runner's ``output_type`` and its uint8 pixels."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.output_type = output_type_of(self.pipeline)

    def generate(self, prompt: str, seed: int, size: int, steps: int) -> np.ndarray:
        with torch.inference_mode():
            images = self.pipeline(prompt, negative_prompt="", width=size, height=size, num_inference_steps=steps,
                                   generator=[torch.Generator().manual_seed(seed)], output_type=self.output_type,
                                   **self.guidance).images
        if self.output_type == "pt":
            return as_pixels(channels_last(images)).numpy()[0]
        return (images * 255).round().clip(0, 255).astype(np.uint8)[0]


def served(client: DiffusionClient, prompt: str, seed: int, size: int, steps: int) -> tuple[np.ndarray, Timings]:
    result = client.generate(prompt, width=size, height=size, steps=steps, seed=seed, guidance_scale=GUIDANCE,
                             output_format="raw", timeout=600)
    return result.images[0].to_numpy(), result.timings


def measure_mode(mode: str, local: RawInProcess, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One server pair batching by ``mode``, against ``local``: interleaved pairs at each step count."""
    runner = start_runner(log_dir, "--batching", mode, "--threads", str(args.threads))
    try:
        worker = start_worker(log_dir, runner.target, "--model", args.model)
        try:
            with DiffusionClient(worker.target) as client:
                for index in range(WARMUP):
                    for steps in args.steps:
                        local.generate(prompt_for(-1 - index), index, args.size, steps)
                        served(client, prompt_for(-1 - index), index, args.size, steps)
                inprocess: dict[int, list[float]] = {steps: [] for steps in args.steps}
                service: dict[int, list[float]] = {steps: [] for steps in args.steps}
                timings: dict[int, list[Timings]] = {steps: [] for steps in args.steps}
                difference: dict[int, int] = {}
                for index in range(args.pairs):
                    for steps in args.steps:
                        prompt = prompt_for(index)
                        started = time.perf_counter()
                        local_image = local.generate(prompt, index, args.size, steps)
                        inprocess[steps].append((time.perf_counter() - started) * 1000)
                        started = time.perf_counter()
                        served_image, served_timings = served(client, prompt, index, args.size, steps)
                        service[steps].append((time.perf_counter() - started) * 1000)
                        timings[steps].append(served_timings)
                        if index == 0:
                            difference[steps] = int(np.abs(served_image.astype(int) - local_image.astype(int)).max())
        finally:
            worker.stop()
    finally:
        runner.stop()
    return summarise(inprocess, service, timings, difference)


def summarise(inprocess: dict[int, list[float]], service: dict[int, list[float]],
              timings: dict[int, list[Timings]], difference: dict[int, int]) -> dict[str, Any]:
    few, many = min(inprocess), max(inprocess)
    local = {steps: statistics.median(values) for steps, values in inprocess.items()}
    remote = {steps: statistics.median(values) for steps, values in service.items()}
    phases = {steps: {name: statistics.median(getattr(timing, name) for timing in values)
                      for name in (field.name for field in dataclasses.fields(Timings))}
              for steps, values in timings.items()}
    added = {steps: [served - local for served, local in zip(service[steps], inprocess[steps], strict=True)]
             for steps in service}
    per_step = ([(long - short) / (many - few) for long, short in zip(added[many], added[few], strict=True)]
                if many > few else None)
    return {"fixed_ms": median_interval(added[few]), "per_step_ms": per_step and median_interval(per_step),
            "inprocess_ms": {str(steps): value for steps, value in local.items()},
            "served_ms": {str(steps): value for steps, value in remote.items()},
            "timings_ms": {str(steps): value for steps, value in phases.items()},
            "max_pixel_difference": {str(steps): value for steps, value in difference.items()},
            "samples": {"inprocess": {str(s): v for s, v in inprocess.items()},
                        "served": {str(s): v for s, v in service.items()}}}


def median_interval(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """The median of ``values`` and a distribution-free interval around it: the ``k``-th smallest
    and the ``k``-th largest, with the largest ``k`` whose binomial(n, 1/2) tail below it is at most
    half of ``1 - confidence`` (n = 15: the 4th and 12th of 15, 96.5%). With fewer than 6 values no
    interval reaches 95%: the least and the most stand in for it."""
    ordered, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n // 2 and tail + math.comb(n, k) / 2 ** n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return {"median": statistics.median(ordered), "low": ordered[max(k - 1, 0)], "high": ordered[n - max(k, 1)]}


def interval_text(interval: dict[str, float], digits: int) -> str:
    return f"{interval['median']:.{digits}f} [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"


def print_table(results: dict[str, Any]) -> None:
    config = results["config"]
    few, many = str(min(config["steps"])), str(max(config["steps"]))
    print(f"{config['model']} {config['size']}x{config['size']}, raw output, {config['pairs']} interleaved pairs: "
          f"medians of the pairs' differences [95% interval], medians of each side; "
          f"load {results['machine']['load_average'][0]:.1f} -> "
          f"{results['machine']['load_average_after'][0]:.1f}")
    floor = results["transport_floor_ms"]
    print(f"transport floor (benchmarks/grpc_floor.py: the same two gRPC calls, no work behind them): "
          f"{floor['two_hops_ms']:.2f} ms, of which the runner's hop {floor['runner_hop_ms']:.2f} ms")
    header = (f"{'batching':<9} {'fixed ms':>22} {'target':>7} {'per step ms':>25} {'target':>7} "
              f"{'served ' + few:>11} {'local ' + few:>10} {'served ' + many:>12} {'local ' + many:>11} "
              f"{'max diff':>9}")
    print(header)
    for mode, row in results["modes"].items():
        per_step = "n/a" if row["per_step_ms"] is None else interval_text(row["per_step_ms"], 3)
        diff = "/".join(str(value) for value in row["max_pixel_difference"].values())
        print(f"{mode:<9} {interval_text(row['fixed_ms'], 2):>22} {'<= ' + str(FIXED_TARGET_MS):>7} {per_step:>25} "
              f"{'<= ' + str(STEP_TARGET_MS):>7} {row['served_ms'][few]:>11.1f} {row['inprocess_ms'][few]:>10.1f} "
              f"{row['served_ms'][many]:>12.1f} {row['inprocess_ms'][many]:>11.1f} {diff:>9}")
    names = [field.name for field in dataclasses.fields(Timings)]
    print("\nserved results' own timings, medians (ms)")
    print(f"{'batching':<9} {'steps':>5} " + " ".join(f"{name.removesuffix('_ms'):>11}" for name in names))
    for mode, row in results["modes"].items():
        for steps, phases in row["timings_ms"].items():
            print(f"{mode:<9} {steps:>5} " + " ".join(f"{phases[name]:>11.2f}" for name in names))


def main() -> None:
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, nargs=2, default=[1, 200], metavar=("FEW", "MANY"),
                        help="the step counts of the short and the long requests")
    parser.add_argument("--pairs", type=int, default=15, help="interleaved pairs per mode and step count")
    parser.add_argument("--modes", nargs="+", choices=["step", "request"], default=["step", "request"],
                        help="the runner's --batching of each server pair")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the runner and of the in-process pipeline (0: torch's default, "
                             "every core); 1 on two cores leaves a core to the worker's and runner's event loops, "
                             "which otherwise preempt a torch thread at every step")
    parser.add_argument("--output", type=Path, default=RESULTS / "overhead.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = new_results(args)
    size = args.size * args.size * 3
    results["transport_floor_ms"] = grpc_floor.measure(FLOOR_CALLS, size)
    local = RawInProcess(ensure_builtin(args.model))
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as logs:
        results["modes"] = {mode: measure_mode(mode, local, args, Path(logs)) for mode in args.modes}
    write_results(results, args.output, print_table)


if __name__ == "__main__":
    main()
