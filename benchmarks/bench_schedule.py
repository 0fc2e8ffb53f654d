"""``python -m benchmarks.bench_schedule``: mixed sizes scheduled by compute (the runner's
``--step-schedule budget``, which the worker follows) against FIFO.

One worker and runner (step-level batching) per schedule, each alone on the machine, taking turns
round after round. Every schedule gets the same requests: Poisson arrivals (seeded), each of one
of three sizes in equal shares, a distinct prompt each. The rate is ``--load`` times FIFO's
closed-loop throughput on the same mix at ``--max-batch-size`` clients, measured in the first
round. A figure is the best of the rounds (lowest small-request p95). Writes
``benchmarks/results/schedule.json`` and prints, per size, p50 and p95 latency from arrival, the
throughput of each schedule, and the ratio of the small requests' p95 (issue 25's target: budget
at most 0.5x FIFO's at equal throughput).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.bench import GUIDANCE, RESULTS, prompt_for, summary
from clients import DiffusionClient
from harness.processes import start_runner, start_worker


class Scheduled:
    """Our worker and runner, scheduling by ``schedule`` (budget: the runner's turns of size groups,
    and the worker's admission by compute that follows them; fifo: in order)."""

    def __init__(self, schedule: str, args: argparse.Namespace, log_dir: Path) -> None:
        self.runner = start_runner(log_dir, *(["--step-schedule", "budget"] if schedule == "budget" else []))
        self.worker = start_worker(log_dir, self.runner.target, "--model", args.model,
                                   "--max-batch-size", str(args.max_batch_size), "--max-queue", "1000")
        self.client = DiffusionClient(self.worker.target)
        self.args = args

    def generate(self, index: int, size: int) -> None:
        self.client.generate(prompt_for(index), width=size, height=size, steps=self.args.steps, seed=index,
                             guidance_scale=GUIDANCE, output_format="png", timeout=1200)

    def stop(self) -> None:
        self.client.close()
        self.worker.stop()
        self.runner.stop()


def sizes_for(args: argparse.Namespace, count: int) -> list[int]:
    """Each request's size: the three sizes in equal shares, in a seeded order."""
    sizes = [args.sizes[index % len(args.sizes)] for index in range(count)]
    np.random.default_rng(args.seed).shuffle(sizes)
    return [int(size) for size in sizes]


def closed_loop(server: Scheduled, sizes: list[int], clients: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda index: server.generate(index, sizes[index]), range(len(sizes))))
    return len(sizes) / (time.perf_counter() - started)


def poisson(server: Scheduled, sizes: list[int], rate: float, seed: int) -> dict:
    """Open loop: exponential gaps of mean 1/rate; each latency counts from its arrival."""
    arrivals = time.perf_counter() + np.cumsum(np.random.default_rng(seed).exponential(1 / rate, len(sizes)))
    latencies: dict[int, list[float]] = {size: [] for size in sizes}
    start = time.perf_counter()

    def one(index: int) -> None:
        time.sleep(max(arrivals[index] - time.perf_counter(), 0))
        server.generate(1000 + index, sizes[index])
        latencies[sizes[index]].append((time.perf_counter() - arrivals[index]) * 1000)

    with ThreadPoolExecutor(len(sizes)) as pool:
        list(pool.map(one, range(len(sizes))))
    return {"rate": rate, "images_per_s": len(sizes) / (time.perf_counter() - start),
            "latency_ms": {str(size): summary(values) for size, values in sorted(latencies.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", default="small")
    parser.add_argument("--sizes", type=int, nargs=3, default=[64, 96, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--load", type=float, default=0.9, help="the arrival rate, as a share of FIFO's throughput")
    parser.add_argument("--rate", type=float, help="the arrival rate in requests/s, instead of --load's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedules", nargs="+", default=["fifo", "budget"], choices=["fifo", "budget"],
                        help="fifo alone measures another checkout's runner against these figures")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
    sizes = sizes_for(args, args.requests)
    rate: float | None = args.rate
    rounds: dict[str, list[dict]] = {schedule: [] for schedule in args.schedules}
    small = str(min(args.sizes))
    for round_index in range(args.rounds):
        for schedule in rounds:
            server = Scheduled(schedule, args, log_dir)
            try:
                server.generate(10_000, max(args.sizes))  # warm: the first run of a fresh process is slow
                if rate is None:
                    rate = args.load * closed_loop(server, sizes_for(args, 3 * args.max_batch_size),
                                                   args.max_batch_size)
                measured = poisson(server, sizes, rate, args.seed)
            finally:
                server.stop()
            rounds[schedule].append(measured)
            print(f"round {round_index + 1} {schedule}: {measured['images_per_s']:.3f} img/s at {rate:.3f}/s; "
                  + ", ".join(f"{size}: p50 {row['p50']:.0f} p95 {row['p95']:.0f} ms"
                              for size, row in measured["latency_ms"].items()), flush=True)
    best = {schedule: min(measured, key=lambda m: m["latency_ms"][small]["p95"])
            for schedule, measured in rounds.items()}
    (RESULTS / "schedule.json").write_text(json.dumps({"config": vars(args), "best": best, "rounds": rounds}, indent=2))
    if len(best) < 2:
        return
    fifo, budget = best["fifo"], best["budget"]
    print(f"throughput budget / FIFO: {budget['images_per_s'] / fifo['images_per_s']:.2f}")
    for size in fifo["latency_ms"]:
        ratio = budget["latency_ms"][size]["p95"] / fifo["latency_ms"][size]["p95"]
        print(f"{size}x{size}: p95 budget / FIFO {ratio:.2f}" + (" (target <= 0.5)" if size == small else ""))


if __name__ == "__main__":
    main()
