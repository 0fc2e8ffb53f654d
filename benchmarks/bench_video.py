"""``python -m benchmarks.bench_video`` (in ``make bench``): video generation served against in-process
diffusers, the worker's MP4 encode, and the VAE decode's peak memory with and without tiles.

- **hop**: the built-in ``tiny-wan`` (``WanPipeline``) through a worker and a runner, raw frames
  back over GenerateStream, against the same pipeline's own ``__call__`` in this process with the
  same arguments and seeds, in interleaved rounds (the order rotating each round), concurrency 1.
  The figure is the median ratio served / in-process (issue 26's target: <= 1.02), beside the
  median of each round's own ratio, the p95s, and the runner's own execute time (the served time
  less the hop); the same seed through both gives the largest pixel difference of their frames.
- **mp4**: in the same rounds, the same video served as MP4: the worker's encode time (its
  ``timings.encode_ms``) and what MP4 adds end to end over raw frames.
- **decode memory**: three runners, started three ways: ``--decode-budget-bytes`` so large that
  frames decode whole (no tiles), without the flag (diffusers' default tiles), and with a budget
  of the runner's own estimate for tiles of ``--memory-tile`` pixels. Each makes one warm-up
  video, then one large video in one step (the decode is then most of the work), called on the
  runner's Execute directly; the runner's ``VmRSS`` before and ``VmHWM`` (peak RSS) after, from
  ``/proc``, beside the runner's estimate of that decode.

Each server runs alone on the machine: the in-process pipeline is idle while the service
generates and the other way round; the memory runners start side by side (a start is mostly
imports) and generate one after the other, each reading only its own process's memory. Writes
``benchmarks/results/video.json`` (``--output``) and prints the figures; ``docs/benchmarks.md``
("Video") records a run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import diffusers
import grpc
import numpy as np
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline

from benchmarks.bench import GUIDANCE, RESULTS, guidance_arguments, new_results, prompt_for, summary, write_results
from benchmarks.bench_limits import peak_rss_mb, status_mb
from clients import DiffusionClient
from clients.types import VideoResult
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from harness.processes import ServiceProcess, start_runner, start_worker
from runner_service.models.catalog import ensure_builtin
from runner_service.video_decode import (
    STRIDE_DENOMINATOR,
    STRIDE_NUMERATOR,
    DecodeEstimate,
    Tiling,
    estimate,
)

MODEL = "tiny-wan"
# A budget no video here comes near: the runner's estimate then fits the whole frame, so no tiles.
NO_TILES_BUDGET = 1 << 50
# The memory runners' warm-up video, before the "before" reading: imports and first-call allocations.
WARM = {"width": 32, "height": 32, "num_frames": 5}


class InProcessVideo:
    """The baseline: ``tiny-wan`` loaded with ``from_pretrained`` and its ``__call__`` called directly,
    with the guidance the served requests get (``bench.guidance_arguments``)."""

    def __init__(self, directory: Path) -> None:
        self.pipeline = DiffusionPipeline.from_pretrained(directory, dtype=torch.float32)
        self.pipeline.set_progress_bar_config(disable=True)
        self.guidance = guidance_arguments(self.pipeline)

    def generate(self, prompt: str, seed: int, args: argparse.Namespace) -> np.ndarray:
        """The video's frames, num_frames x height x width x 3 uint8, as the runner rounds them."""
        with torch.inference_mode():
            frames = self.pipeline(prompt, negative_prompt="", width=args.size, height=args.size,
                                   num_frames=args.frames, num_inference_steps=args.steps,
                                   generator=[torch.Generator().manual_seed(seed)], output_type="np",
                                   **self.guidance).frames
        video: np.ndarray = (np.asarray(frames)[0] * 255).round().clip(0, 255).astype(np.uint8)
        return video


def served(client: DiffusionClient, prompt: str, seed: int, args: argparse.Namespace,
           output_format: str) -> VideoResult:
    """The same video through the worker and runner; no separate frames (raw output is the frames)."""
    return client.generate_video(prompt, num_frames=args.frames, fps=args.fps, width=args.size, height=args.size,
                                 steps=args.steps, guidance_scale=GUIDANCE, seed=seed,
                                 output_format=output_format, return_frames=False, timeout=600)


def timed(call: Callable[[int], Any], index: int) -> tuple[Any, float]:
    """``call(index)``'s value and its wall time in ms."""
    started = time.perf_counter()
    value = call(index)
    return value, (time.perf_counter() - started) * 1000


def bench_hop(client: DiffusionClient, local: InProcessVideo, args: argparse.Namespace) -> dict[str, Any]:
    """Served raw, served MP4 and in-process, interleaved: round i runs all three (request i's prompt
    and seed), starting one further along each round so no leg always follows the same one."""
    legs: dict[str, Callable[[int], Any]] = {
        "inprocess": lambda i: local.generate(prompt_for(i), i, args),
        "raw": lambda i: served(client, prompt_for(i), i, args, "raw"),
        "mp4": lambda i: served(client, prompt_for(i), i, args, "mp4"),
    }
    for name, leg in legs.items():  # warm: a fresh process's first call is slow
        leg(10_000 + len(name))
    times: dict[str, list[float]] = {name: [] for name in legs}
    encode_ms: list[float] = []
    execute_ms: list[float] = []  # the runner's own time for the raw leg's video
    mp4_bytes = 0
    names = list(legs)
    for index in range(args.repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            value, elapsed = timed(legs[name], index)
            times[name].append(elapsed)
            if name == "raw":
                execute_ms.append(value.timings.execute_ms)
            if name == "mp4":
                encode_ms.append(value.timings.encode_ms)
                mp4_bytes = len(value.data)
    raw, local_ms, mp4 = (statistics.median(times[name]) for name in ("raw", "inprocess", "mp4"))
    return {
        "service_ms": summary(times["raw"]), "inprocess_ms": summary(times["inprocess"]),
        "runner_execute_ms": summary(execute_ms),
        # Each raw video's served time less its runner's execute time: the worker, the two
        # loopback hops of its frames and the client's assembly of them.
        "hop_ms": summary([ms - runner_ms for ms, runner_ms in zip(times["raw"], execute_ms, strict=True)]),
        "median_ratio": raw / local_ms,
        # Each round's own ratio, then their median: a load that comes and goes between rounds
        # moves both legs of a round alike.
        "paired_median_ratio": statistics.median(
            ms / local_round_ms for ms, local_round_ms in zip(times["raw"], times["inprocess"], strict=True)),
        "p95_ratio": summary(times["raw"])["p95"] / summary(times["inprocess"])["p95"],
        "mp4": {"service_ms": summary(times["mp4"]), "encode_ms": summary(encode_ms), "bytes": mp4_bytes,
                "over_raw_median_ms": mp4 - raw, "median_ratio_to_raw": mp4 / raw},
    }


def bench_identical(client: DiffusionClient, local: InProcessVideo, args: argparse.Namespace) -> dict[str, Any]:
    """The same prompt and seed served and in-process: the largest difference of a pixel channel."""
    frames = served(client, prompt_for(4242), 4242, args, "raw").frames
    assert frames is not None  # raw output: the data are the frames
    expected = local.generate(prompt_for(4242), 4242, args)
    return {"frames": len(frames), "max_pixel_difference": int(np.abs(frames.astype(np.int16) - expected).max())}


def execute_video(stub: runner_pb2_grpc.RunnerServiceStub, request_id: str, size: int, frames: int,
                  steps: int) -> dict[str, float]:
    """One text-to-video item on the runner's Execute; the frame bytes received and its execute_ms."""
    item = runner_pb2.ExecuteItem(request_id=request_id, prompt=prompt_for(0), width=size, height=size,
                                  num_inference_steps=steps, guidance_scale=GUIDANCE, seed=0,
                                  num_images=1, task=common_pb2.TASK_TEXT_TO_VIDEO, num_frames=frames)
    received = 0
    execute_ms = 0.0
    for response in stub.Execute(runner_pb2.ExecuteRequest(items=[item], progress=True), timeout=1800):
        kind = response.WhichOneof("event")
        if kind == "frames":
            received += len(response.frames.pixels)
        elif kind == "result":
            execute_ms = response.result.execute_ms
    expected = frames * size * size * 3
    if received != expected:
        raise RuntimeError(f"{request_id}: received {received} bytes of frames, not {expected}")
    return {"execute_ms": execute_ms, "frame_bytes": received}


def memory_runner(log_dir: Path, flags: list[str], args: argparse.Namespace) -> ServiceProcess:
    """A runner serving the model with ``flags``, taking the large video's frames."""
    return start_runner(log_dir, "--model", MODEL, "--max-frames", str(max(args.memory_frames, WARM["num_frames"])),
                        *flags)


def decode_peak(runner: ServiceProcess, args: argparse.Namespace) -> dict[str, float]:
    """``runner``'s RSS before the large video and its peak RSS after; stopped after."""
    try:
        options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(runner.target, options=options) as channel:
            stub = runner_pb2_grpc.RunnerServiceStub(channel)
            execute_video(stub, "warm", WARM["width"], WARM["num_frames"], 1)
            rss_before = status_mb(runner.pid, "VmRSS")
            peak_before = max(rss_before, peak_rss_mb(runner.pid))
            run = execute_video(stub, "large", args.memory_size, args.memory_frames, 1)
            peak_after = max(peak_before, peak_rss_mb(runner.pid))
    finally:
        runner.stop()
    return {"rss_before_mb": rss_before, "peak_before_mb": peak_before, "peak_after_mb": peak_after,
            "growth_mb": peak_after - rss_before, **run}


def decode_plan(args: argparse.Namespace) -> tuple[int, dict[str, Tiling], DecodeEstimate]:
    """The budgeted runner's budget: the runner's own estimate (``video_decode``) of the large
    video's decode in tiles of ``--memory-tile`` pixels, so that it picks those tiles; the tiles
    each runner decodes it in; and the estimate."""
    vae = AutoencoderKLWan.from_pretrained(ensure_builtin(MODEL), subfolder="vae")
    found = estimate(vae, args.memory_frames, args.memory_size, args.memory_size)
    assert found is not None  # a Wan VAE
    budget = found.peak(Tiling(args.memory_tile, args.memory_tile * STRIDE_NUMERATOR // STRIDE_DENOMINATOR))
    vae.enable_tiling()  # diffusers' default tiles, where the frame is larger than one
    default = Tiling(int(vae.tile_sample_min_height), int(vae.tile_sample_stride_height))
    whole = Tiling(0, 0)
    budgeted = found.tiling_within(budget)
    assert budgeted is not None  # the budget is the estimate of some tiles
    tilings = {"untiled": whole, "default_tiles": default if args.memory_size > default.tile else whole,
               "budget": budgeted}
    return budget, tilings, found


def bench_decode_memory(log_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The large video's peak on three runners: frames whole, diffusers' default tiles, the budget's;
    beside each, the tiles it decodes in and the runner's estimate of that decode's peak."""
    budget, tilings, found = decode_plan(args)
    flags = {"untiled": ["--decode-budget-bytes", str(NO_TILES_BUDGET)], "default_tiles": [],
             "budget": ["--decode-budget-bytes", str(budget)]}
    with ExitStack() as stack:  # every runner started is stopped, also when another fails
        with ThreadPoolExecutor(len(flags)) as pool:
            starts = {name: pool.submit(memory_runner, log_dir, runner_flags, args)
                      for name, runner_flags in flags.items()}
        for start in starts.values():
            if start.exception() is None:
                stack.callback(start.result().stop)
        runs = {name: decode_peak(start.result(), args) for name, start in starts.items()}
    for name, run in runs.items():
        run["tile"] = tilings[name].tile
        run["estimate_mb"] = found.peak(tilings[name]) / 2**20
    untiled = runs["untiled"]
    # None where the untiled decode needed no memory beyond what the runner already held (a toy
    # size can fit in what the warm-up left): there is no growth to compare with.
    growth_ratio = {name: run["growth_mb"] / untiled["growth_mb"] if untiled["growth_mb"] > 0 else None
                    for name, run in runs.items()}
    return {**runs, "budget_mb": budget / 2**20,
            "peak_ratio": {name: run["peak_after_mb"] / untiled["peak_after_mb"] for name, run in runs.items()},
            "growth_ratio": growth_ratio}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--size", type=int, default=256, help="width and height of the hop's videos")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fps", type=int, default=8, help="the MP4's rate (the frames do not depend on it)")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved rounds")
    parser.add_argument("--memory-size", type=int, default=512, help="width and height of the large video")
    parser.add_argument("--memory-frames", type=int, default=17)
    parser.add_argument("--memory-tile", type=int, default=128,
                        help="the budgeted runner's tiles: its --decode-budget-bytes is its own estimate of the "
                             "large video's decode in tiles of this many pixels")
    parser.add_argument("--parts", nargs="+", default=["hop", "memory"], choices=["hop", "memory"])
    parser.add_argument("--output", type=Path, default=RESULTS / "video.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    args = parse(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-video-"))
    results = new_results(args)
    if "hop" in args.parts:
        local = InProcessVideo(ensure_builtin(MODEL))
        runner = start_runner(log_dir)
        try:
            worker = start_worker(log_dir, runner.target, "--model", MODEL)
            try:
                with DiffusionClient(worker.target) as client:
                    results["identical"] = bench_identical(client, local, args)
                    results["hop"] = bench_hop(client, local, args)
            finally:
                worker.stop()
        finally:
            runner.stop()
        del local
    if "memory" in args.parts:
        results["decode_memory"] = bench_decode_memory(log_dir, args)
    return write_results(results, args.output, print_table)


def print_table(results: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    if "hop" in results:
        hop, mp4 = results["hop"], results["hop"]["mp4"]
        rows += [
            ("served raw / in-process, median", f"{hop['median_ratio']:.4f}", "<= 1.02"),
            ("  median of each round's ratio", f"{hop['paired_median_ratio']:.4f}", ""),
            ("  served p50 / p95 ms", f"{hop['service_ms']['p50']:.1f} / {hop['service_ms']['p95']:.1f}", ""),
            ("  in-process p50 / p95 ms", f"{hop['inprocess_ms']['p50']:.1f} / {hop['inprocess_ms']['p95']:.1f}", ""),
            ("  runner's execute p50 ms", f"{hop['runner_execute_ms']['p50']:.1f}", "(within the served time)"),
            ("  served less execute p50 / p95 ms", f"{hop['hop_ms']['p50']:.1f} / {hop['hop_ms']['p95']:.1f}",
             "worker, hops, client"),
            ("  max pixel difference, same seed", str(results["identical"]["max_pixel_difference"]), "<= 1"),
            ("MP4: worker encode p50 / p95 ms", f"{mp4['encode_ms']['p50']:.1f} / {mp4['encode_ms']['p95']:.1f}",
             f"{mp4['bytes']} bytes"),
            ("  served MP4 / raw, median", f"{mp4['median_ratio_to_raw']:.4f}", f"{mp4['over_raw_median_ms']:+.1f} ms"),
        ]
    if "decode_memory" in results:
        memory = results["decode_memory"]
        for name in ("untiled", "default_tiles", "budget"):
            run, ratio = memory[name], memory["growth_ratio"][name]
            growth = f"x{ratio:.2f} of untiled growth" if ratio is not None else "no untiled growth to compare"
            rows.append((f"decode {name}: peak RSS / growth MB",
                         f"{run['peak_after_mb']:.0f} / {run['growth_mb']:.0f}",
                         f"{growth}, {run['execute_ms']:.0f} ms"))
    width = max(len(row[0]) for row in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:<24} {note}")


if __name__ == "__main__":
    main()
