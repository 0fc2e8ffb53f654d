"""``make bench`` (``python -m benchmarks.bench_serving``), serving under load: step-level
batching, request-level batching, LitServe and in-process diffusers, serving the same pipeline
side by side.

Each server runs alone on the machine (started, measured, stopped; LitServe's process group
killed), and the servers take turns, round after round; a figure is the best of the rounds. Each
is driven closed-loop at every ``--concurrency`` and, open-loop, by Poisson arrivals at
``--poisson-load`` of request-level batching's throughput at the highest concurrency. PNG out
everywhere. Every system gets the same requests: a distinct prompt each (``bench.prompt_for``),
so no prompt cache is flattered; ``--prompt-repeat R`` sends a share R of them with one repeated
prompt. The prompt cache's own win is reported apart: the ``cached`` mode is step-level batching
at one client with every prompt repeated, against ``step`` with distinct ones. The guidance is
7.5 everywhere (true CFG for ``shapes``: ``bench.guidance_arguments``). Writes
``benchmarks/results/serving-MODEL.json`` and ``serving-MODEL.png`` and prints the ratios
against the targets of issue 25.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.bench import GUIDANCE, RESULTS, InProcess, prompt_for, summary
from clients import DiffusionClient
from harness.processes import REPO, free_port, start_runner, start_worker, wait_until
from runner_service.models.catalog import ensure_builtin

Generate = Callable[[int], None]  # request number i: its prompt and its seed


class Served:
    """Our worker and runner, with the runner batching at steps or per request."""

    def __init__(self, batching: str, args: argparse.Namespace, log_dir: Path, repeat: float) -> None:
        self.runner = start_runner(log_dir, "--batching", batching)
        self.worker = start_worker(log_dir, self.runner.target, "--model", args.model, "--max-batch-size",
                                   str(args.max_batch_size), "--max-batch-delay-ms", str(args.batch_delay_ms))
        self.client = DiffusionClient(self.worker.target)
        self.args = args
        self.repeat = repeat

    def generate(self, seed: int) -> None:
        self.client.generate(prompt_for(seed, self.repeat), width=self.args.size, height=self.args.size,
                             steps=self.args.steps, seed=seed, guidance_scale=GUIDANCE, output_format="png",
                             timeout=600)

    def stop(self) -> None:
        self.client.close()
        self.worker.stop()
        self.runner.stop()


class LitServed:
    """LitServe over the same pipeline (``litserve_server.py``), in its own process group."""

    def __init__(self, args: argparse.Namespace, directory: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.args = args
        log = open(log_dir / "litserve.log", "w")  # noqa: SIM115 - open while the server runs
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.litserve_server", str(directory), str(self.port),
             str(args.max_batch_size), str(args.batch_delay_ms / 1000)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        wait_until(self._healthy, 120, "LitServe healthy")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def generate(self, seed: int) -> None:
        body = json.dumps({"prompt": prompt_for(seed, self.args.prompt_repeat), "seed": seed, "size": self.args.size,
                           "steps": self.args.steps})
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/predict", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            base64.b64decode(json.loads(response.read())["png"])

    def stop(self) -> None:
        # Its forked workers outlive a plain terminate: stop the whole group.
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class InProcessServed:
    """diffusers called directly, one request at a time on one thread, PNG-encoded like the
    servers' answers. One thread, as the runner does: each thread that calls torch gets its own
    OpenMP team, and a second team spinning idle beside the working one slowed this baseline by
    half on two cores."""

    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="in-process")
        self.local = self.thread.submit(InProcess, directory).result()
        self.args = args

    def _generate(self, seed: int) -> None:
        image = self.local.generate(prompt_for(seed, self.args.prompt_repeat), seed, self.args.size, self.args.steps)
        Image.fromarray(image).save(io.BytesIO(), format="PNG")

    def generate(self, seed: int) -> None:
        self.thread.submit(self._generate, seed).result()

    def stop(self) -> None:
        self.thread.shutdown()
        del self.local


def closed_loop(generate: Generate, concurrency: int, requests: int) -> dict:
    latencies: list[float] = []

    def one(seed: int) -> None:
        started = time.perf_counter()
        generate(seed)
        latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    return {"images_per_s": requests / (time.perf_counter() - started), "latency_ms": summary(latencies)}


def poisson(generate: Generate, rate: float, requests: int, seed: int = 0) -> dict:
    """Open loop: requests arrive at exponential gaps of mean 1/rate; latency counts from arrival."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, requests)
    latencies: list[float] = []
    start = time.perf_counter()
    arrivals = start + np.cumsum(gaps)

    def one(index: int) -> None:
        time.sleep(max(arrivals[index] - time.perf_counter(), 0))
        generate(index)
        latencies.append((time.perf_counter() - arrivals[index]) * 1000)

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    return {"rate": rate, "images_per_s": requests / (time.perf_counter() - start), "latency_ms": summary(latencies)}


def measure(server: Served | LitServed | InProcessServed, args: argparse.Namespace, mode: str) -> dict:
    server.generate(10_000)  # warm: the first run of a fresh process is slow
    levels = [1] if mode in ("inprocess", "cached") else args.concurrency
    return {str(c): closed_loop(server.generate, c, max(args.min_requests, 2 * c)) for c in levels}


def best(rounds: list[dict]) -> dict:
    """Per load, the round with the highest throughput."""
    return {load: max((r[load] for r in rounds if load in r), key=lambda x: x["images_per_s"])
            for load in rounds[0]}


MODES = ("step", "request", "litserve", "inprocess", "cached")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", default="small")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--min-requests", type=int, default=6)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-delay-ms", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--poisson-load", type=float, default=0.8)
    parser.add_argument("--poisson-requests", type=int, default=24)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prompt-repeat", type=float, default=0.0,
                        help="share of requests that repeat one prompt (0: every prompt distinct; the cached "
                             "mode repeats every one)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    RESULTS.mkdir(exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    directory = ensure_builtin(args.model)
    rounds: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    rate: float | None = None
    top = str(max(args.concurrency))
    for round_index in range(args.rounds):
        # request-level first: its top throughput sets the Poisson rate for everyone.
        for mode in sorted(args.modes, key=lambda m: m != "request"):
            if mode == "litserve":
                server: Served | LitServed | InProcessServed = LitServed(args, directory, log_dir)
            elif mode == "inprocess":
                server = InProcessServed(args, directory)
            elif mode == "cached":
                server = Served("step", args, log_dir, repeat=1.0)
            else:
                server = Served(mode, args, log_dir, args.prompt_repeat)
            try:
                measured = measure(server, args, mode)
                if mode == "request" and rate is None:
                    rate = args.poisson_load * measured[top]["images_per_s"]
                if rate is not None and mode not in ("inprocess", "cached"):
                    measured["poisson"] = poisson(server.generate, rate, args.poisson_requests)
            finally:
                server.stop()
            rounds[mode].append(measured)
            print(f"round {round_index + 1} {mode}: " + ", ".join(
                f"{load} {row['images_per_s']:.3f}/s p95 {row['latency_ms']['p95']:.0f} ms"
                for load, row in measured.items()), flush=True)
    results = {"config": vars(args), "best": {mode: best(rounds[mode]) for mode in args.modes}, "rounds": rounds}
    (RESULTS / f"serving-{args.model}.json").write_text(json.dumps(results, indent=2))
    chart(results["best"], args, RESULTS / f"serving-{args.model}.png")
    report(results["best"], args)


def chart(best_of: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = [str(c) for c in args.concurrency]
    for mode, loads in best_of.items():
        shown = [c for c in levels if c in loads]
        left.plot([int(c) for c in shown], [loads[c]["images_per_s"] for c in shown], marker="o", label=mode)
        right.plot([int(c) for c in shown], [loads[c]["latency_ms"]["p95"] for c in shown], marker="o", label=mode)
    left.set(xlabel="concurrent clients", ylabel="images / s", title="Throughput", xticks=args.concurrency)
    right.set(xlabel="concurrent clients", ylabel="ms", title="Latency p95", xticks=args.concurrency)
    left.legend()
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def report(best_of: dict, args: argparse.Namespace) -> None:
    rows = []
    for mode, loads in best_of.items():
        for load, row in loads.items():
            latency = row["latency_ms"]
            rows.append(f"{mode:<10} {load:>8}  {row['images_per_s']:7.3f} img/s  p50 {latency['p50']:7.0f}  "
                        f"p95 {latency['p95']:7.0f}  p99 {latency['p99']:7.0f} ms")
    print("\n".join(rows))
    step, lit, inprocess, cached = (best_of.get(mode) for mode in ("step", "litserve", "inprocess", "cached"))
    top = str(max(args.concurrency))
    if step and lit:
        for load in (load for load in step if load in lit and load != "poisson"):
            print(f"{load}: throughput step / LitServe {step[load]['images_per_s'] / lit[load]['images_per_s']:.2f} "
                  f"(target >= {'1.0' if load == '1' else '1.2'})")
        print(f"c={top} p95 step / LitServe: {step[top]['latency_ms']['p95'] / lit[top]['latency_ms']['p95']:.2f} "
              "(target <= 0.8)")
    if step and inprocess:
        print(f"c=1 step / in-process: {step['1']['images_per_s'] / inprocess['1']['images_per_s']:.3f}")
    if step and cached:
        print(f"c=1 the prompt cache's win, every prompt repeated / distinct: "
              f"{cached['1']['images_per_s'] / step['1']['images_per_s']:.3f}")

if __name__ == "__main__":
    main()
