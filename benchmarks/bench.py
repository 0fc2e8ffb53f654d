"""``make bench``: the serving system against in-process diffusers, side by side in one run.

Every figure that matters is a ratio of two things measured in the same run, interleaved where
possible, because these machines are noisy. Writes a table to stdout, JSON and a PNG chart to
``benchmarks/results/``; ``docs/benchmarks.md`` records a run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import diffusers
import grpc
import numpy as np
import torch
from diffusers import DiffusionPipeline
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file, save_file

from clients import DiffusionClient
from diffusion.v1 import runner_pb2, runner_pb2_grpc
from harness.processes import start_runner, start_worker
from runner_service.denoising.loop import max_sequence_length
from runner_service.models.catalog import ensure_builtin
from serving_common.memory import trim_host_heap

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "a lighthouse on a cliff at dusk"


def prompt_for(index: int, repeat: float = 0.0) -> str:
    """Request ``index``'s prompt, the same for every system measured. Distinct per request by
    default, as users rarely repeat one, so no system's prompt cache is flattered; a seeded
    ``repeat`` share of requests sends ``PROMPT`` again, to measure such a cache on purpose."""
    if repeat and random.Random(index).random() < repeat:
        return PROMPT
    return f"{PROMPT}, view {index}"


def new_results(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's results, begun: the machine it runs on (its load now) and the flags it ran with."""
    config = {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}
    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__, "diffusers": diffusers.__version__,
                        "threads": torch.get_num_threads(), "load_average": os.getloadavg()},
            "config": config}


def write_results(results: dict[str, Any], output: Path, print_table: Callable[[dict[str, Any]], None]
                  ) -> dict[str, Any]:
    """Records the load average at the end beside ``results["machine"]``'s, writes the JSON to
    ``output`` and prints the table; returns the results."""
    results["machine"]["load_average_after"] = os.getloadavg()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print_table(results)
    return results


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "p99": percentile(values, 99),
            "mean": statistics.fmean(values), "n": len(values)}


GUIDANCE = 7.5  # every system's guidance: classifier-free, or true CFG where that is the model's


def guidance_arguments(pipeline: DiffusionPipeline) -> dict[str, Any]:
    """How a user of diffusers asks ``pipeline`` for the guidance the served requests get: a Flux
    without a guidance embedding (the ``shapes`` model) guides by ``true_cfg_scale`` and reads as
    many T5 tokens as its tokenizer has (``max_sequence_length``), as the runner calls it."""
    parameters = inspect.signature(pipeline.__call__).parameters
    transformer = pipeline.components.get("transformer")
    if "true_cfg_scale" in parameters and not getattr(getattr(transformer, "config", None), "guidance_embeds", True):
        return {"true_cfg_scale": GUIDANCE, **max_sequence_length(pipeline)}
    return {"guidance_scale": GUIDANCE}


class InProcess:
    """The baseline: the same pipeline, loaded with ``from_pretrained`` and called directly."""

    def __init__(self, directory: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.pipeline = DiffusionPipeline.from_pretrained(directory, dtype=dtype).to(device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.guidance = guidance_arguments(self.pipeline)

    def generate(self, prompt: str, seed: int, size: int, steps: int) -> np.ndarray:
        with torch.inference_mode():
            images = self.pipeline(prompt, negative_prompt="", width=size, height=size, num_inference_steps=steps,
                                   generator=[torch.Generator().manual_seed(seed)], output_type="np",
                                   **self.guidance).images
        return (images * 255).round().clip(0, 255).astype(np.uint8)[0]


def bench_hop(client: DiffusionClient, local: InProcess, args) -> dict:
    """Item 1: end to end through worker and runner against in-process, interleaved, concurrency 1."""
    service, inprocess = [], []
    for index in range(args.repeats):
        started = time.perf_counter()
        local.generate(prompt_for(index), index, args.size, args.steps)
        inprocess.append(time.perf_counter() - started)
        started = time.perf_counter()
        client.generate(prompt_for(index), width=args.size, height=args.size, steps=args.steps, seed=index,
                        output_format="raw")
        service.append(time.perf_counter() - started)
    served, local_ms = statistics.median(service) * 1000, statistics.median(inprocess) * 1000
    return {"service_ms": summary([s * 1000 for s in service]), "inprocess_ms": summary([s * 1000 for s in inprocess]),
            "median_ratio": served / local_ms}


def bench_identical(client: DiffusionClient, local: InProcess, args) -> dict:
    """Same seed through the service and in-process: the largest pixel difference."""
    served = client.generate(PROMPT, width=args.size, height=args.size, steps=args.steps, seed=4242,
                             output_format="raw").images[0].to_numpy()
    local_image = local.generate(PROMPT, 4242, args.size, args.steps)
    return {"max_pixel_difference": int(np.abs(served.astype(int) - local_image.astype(int)).max())}


def throughput(client: DiffusionClient, concurrency: int, requests: int, args) -> dict:
    latencies: list[float] = []

    def one(index: int) -> None:
        started = time.perf_counter()
        client.generate(prompt_for(index), width=args.size, height=args.size, steps=args.steps, seed=index,
                        output_format="raw", timeout=600)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    elapsed = time.perf_counter() - started
    return {"images_per_s": requests / elapsed, "latency_ms": summary([x * 1000 for x in latencies])}


def bench_control(client: DiffusionClient, target: str, count: int = 300) -> dict:
    """Item 4: GetStatus and health Check latency."""
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    status_ms, health_ms = [], []
    for _ in range(count):
        started = time.perf_counter()
        client.status()
        status_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(service="diffusion.v1.WorkerService"))
        health_ms.append((time.perf_counter() - started) * 1000)
    return {"get_status_ms": summary(status_ms), "health_check_ms": summary(health_ms)}


def bench_sleep(runner_target: str, directory: Path, args) -> dict:
    """Item 3: sleep and wake times with bytes moved, beside this machine's copy and read limits."""
    stub = runner_pb2_grpc.RunnerServiceStub(grpc.insecure_channel(runner_target))

    def timed(call, request):
        started = time.perf_counter()
        reply = call(request)
        return reply, time.perf_counter() - started

    slept, sleep1_s = timed(stub.Sleep, runner_pb2.RunnerServiceSleepRequest(level=1))
    woke, wake1_s = timed(stub.WakeUp, runner_pb2.RunnerServiceWakeUpRequest())
    _, sleep2_s = timed(stub.Sleep, runner_pb2.RunnerServiceSleepRequest(level=2))
    woke2, wake2_s = timed(stub.WakeUp, runner_pb2.RunnerServiceWakeUpRequest())
    moved = slept.weight_bytes_released

    # The machine's limits, in the same run, on the model's own weight files: a plain tensor
    # copy, writing safetensors, and reading them back into freshly allocated memory (the heap
    # trimmed first, as a sleeping runner's is, so the page faults are counted too).
    files = sorted(directory.glob("*/*.safetensors"))
    trim_host_heap()
    started = time.perf_counter()
    weights = {f"{i}.{k}": v.clone() for i, f in enumerate(files) for k, v in load_file(f).items()}
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    copies = {k: v.clone() for k, v in weights.items()}
    copy_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        started = time.perf_counter()
        save_file(weights, path)
        write_s = time.perf_counter() - started
    del copies, weights
    trim_host_heap()
    gb = moved / 1e9
    return {
        "bytes_moved": moved,
        "sleep1_s": sleep1_s, "wake1_s": wake1_s, "sleep2_s": sleep2_s, "wake2_s": wake2_s,
        "sleep1_gb_s": gb / sleep1_s, "wake1_gb_s": woke.weight_bytes_restored / 1e9 / wake1_s,
        "wake2_gb_s": woke2.weight_bytes_restored / 1e9 / wake2_s,
        "limit_copy_gb_s": gb / copy_s, "limit_write_gb_s": gb / write_s, "limit_read_gb_s": gb / read_s,
        # CPU level 1 writes a spill file and reads it back: the write and read speeds bound it.
        "sleep1_of_limit": write_s / sleep1_s,
        "wake1_of_limit": (woke.weight_bytes_restored / 1e9 / wake1_s) / (gb / read_s),
        "wake2_of_limit": (woke2.weight_bytes_restored / 1e9 / wake2_s) / (gb / read_s),
    }


def bench_progress(runner_target: str, args) -> dict:
    """Item 6: the same execution with and without per-step events, interleaved."""
    stub = runner_pb2_grpc.RunnerServiceStub(grpc.insecure_channel(runner_target))
    timings: dict[bool, list[float]] = {True: [], False: []}
    for index in range(args.repeats):
        for progress in (True, False):
            # A prompt of its own for each run: a cached one would favour whichever runs second.
            item = runner_pb2.ExecuteItem(request_id=f"p{index}", prompt=prompt_for(2 * index + progress),
                                          width=args.size, height=args.size, num_inference_steps=args.steps,
                                          guidance_scale=7.5, seed=index, num_images=1)
            started = time.perf_counter()
            list(stub.Execute(runner_pb2.ExecuteRequest(items=[item], progress=progress)))
            timings[progress].append(time.perf_counter() - started)
    on, off = statistics.median(timings[True]), statistics.median(timings[False])
    return {"with_progress_ms": on * 1000, "without_progress_ms": off * 1000, "ratio": on / off}


def bench_cold_start(directory: Path, log_dir: Path, model: str) -> dict:
    """Item 5: runner process start to a loaded model, against ``from_pretrained`` alone."""
    started = time.perf_counter()
    runner = start_runner(log_dir, "--model", model)
    ready_s = time.perf_counter() - started
    runner.stop()
    code = ("import time, diffusers; t = time.perf_counter(); "
            f"diffusers.DiffusionPipeline.from_pretrained({str(directory)!r}); print(time.perf_counter() - t)")
    started = time.perf_counter()
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    process_s = time.perf_counter() - started
    return {"runner_start_to_ready_s": ready_s, "from_pretrained_s": float(output.split()[-1]),
            "python_with_from_pretrained_s": process_s}


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = sorted(int(c) for c in results["throughput"]["batched"])
    for mode in ("batched", "unbatched"):
        left.plot(levels, [results["throughput"][mode][str(c)]["images_per_s"] for c in levels], marker="o",
                  label=f"service, {mode}")
    left.axhline(results["throughput"]["inprocess_sequential"]["images_per_s"], color="grey", linestyle="--",
                 label="in-process, sequential")
    left.set(xlabel="concurrent clients", ylabel="images / s", title="Throughput", xticks=levels)
    left.legend()
    for mode in ("batched", "unbatched"):
        right.plot(levels, [results["throughput"][mode][str(c)]["latency_ms"]["p95"] for c in levels], marker="o",
                   label=f"p95, {mode}")
    right.set(xlabel="concurrent clients", ylabel="ms", title="Latency p95", xticks=levels)
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", default="small")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-batch-size", type=int, default=8)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    directory = ensure_builtin(args.model)
    results: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                 "torch": torch.__version__, "threads": torch.get_num_threads()},
                     "config": vars(args)}
    local = InProcess(directory)
    runner = start_runner(log_dir)
    try:
        batched = start_worker(log_dir, runner.target, "--model", args.model, "--max-batch-size",
                               str(args.max_batch_size), "--max-batch-delay-ms", "5")
        with DiffusionClient(batched.target) as client:
            results["identical"] = bench_identical(client, local, args)
            results["hop"] = bench_hop(client, local, args)
            results["control"] = bench_control(client, batched.target)
            requests = max(args.concurrency) * 2
            results["throughput"] = {"batched": {}, "unbatched": {}}
            for concurrency in args.concurrency:
                results["throughput"]["batched"][str(concurrency)] = throughput(client, concurrency, requests, args)
        batched.stop()
        unbatched = start_worker(log_dir, runner.target, "--model", args.model, "--max-batch-size", "1")
        with DiffusionClient(unbatched.target) as client:
            for concurrency in args.concurrency:
                results["throughput"]["unbatched"][str(concurrency)] = throughput(client, concurrency, requests, args)
        unbatched.stop()
        started = time.perf_counter()
        for index in range(requests):
            local.generate(prompt_for(index), index, args.size, args.steps)
        results["throughput"]["inprocess_sequential"] = {"images_per_s": requests / (time.perf_counter() - started)}
        results["progress"] = bench_progress(runner.target, args)
        results["sleep"] = bench_sleep(runner.target, directory, args)
    finally:
        runner.stop()
    results["cold_start"] = bench_cold_start(directory, log_dir, args.model)
    (RESULTS / "bench.json").write_text(json.dumps(results, indent=2))
    chart(results, RESULTS / "throughput.png")
    print_table(results)


def print_table(results: dict) -> None:
    hop, control, sleep = results["hop"], results["control"], results["sleep"]
    rows = [
        ("1. e2e service / in-process (median)", f"{hop['median_ratio']:.4f}", "<= 1.01"),
        ("   service median ms", f"{hop['service_ms']['p50']:.1f}", ""),
        ("   in-process median ms", f"{hop['inprocess_ms']['p50']:.1f}", ""),
        ("   max pixel difference, same seed", str(results["identical"]["max_pixel_difference"]), "0"),
    ]
    base = results["throughput"]["inprocess_sequential"]["images_per_s"]
    rows.append(("2. in-process sequential images/s", f"{base:.3f}", ""))
    for mode in ("batched", "unbatched"):
        for concurrency, row in results["throughput"][mode].items():
            latency = row["latency_ms"]
            rows.append((f"   {mode} c={concurrency} images/s (x in-process)",
                         f"{row['images_per_s']:.3f} ({row['images_per_s'] / base:.2f}x)",
                         f"p50 {latency['p50']:.0f} p95 {latency['p95']:.0f} p99 {latency['p99']:.0f} ms"))
    rows += [
        ("3. sleep L1 / wake L1 / wake L2 s", f"{sleep['sleep1_s']:.3f} / {sleep['wake1_s']:.3f} / "
                                              f"{sleep['wake2_s']:.3f}", f"{sleep['bytes_moved'] / 1e6:.1f} MB"),
        ("   sleep L1 of safetensors write limit", f"{sleep['sleep1_of_limit']:.0%}", ">= 70%"),
        ("   wake L1 of read limit", f"{sleep['wake1_of_limit']:.0%}", ">= 70%"),
        ("   wake L2 of read limit", f"{sleep['wake2_of_limit']:.0%}", ">= 70%"),
        ("4. GetStatus p50 / p99 ms", f"{control['get_status_ms']['p50']:.2f} / {control['get_status_ms']['p99']:.2f}",
         "p50 < 2"),
        ("   health Check p50 / p99 ms",
         f"{control['health_check_ms']['p50']:.2f} / {control['health_check_ms']['p99']:.2f}", "p50 < 2"),
        ("5. runner start to ready / from_pretrained s",
         f"{results['cold_start']['runner_start_to_ready_s']:.2f} / {results['cold_start']['from_pretrained_s']:.2f}",
         ""),
        ("6. progress on / off (median)", f"{results['progress']['ratio']:.4f}", "~1.00"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<28} {target}")


if __name__ == "__main__":
    main()
