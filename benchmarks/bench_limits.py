"""``bench_limits``: the worker's memory and responsiveness under the resource attacks of issue 20.

For each attack it records the resident memory of the process attacked (``VmRSS`` from
``/proc/<pid>/status``) idle before, at its peak during (``VmHWM``, reset at the start, and a
20 ms poll) and after it ends, while a prober on its own channel keeps calling gRPC Generate (a
2-step text-to-image) and the health Check: their success and latency say whether the service
kept answering. Attacks:

- ``images`` (item 5): concurrent Generates, each with a 2048 x 2048 noise PNG (12.6 MB) resized
  to 64 x 64; the target is a worker under 600 MB that returns near idle afterwards;
- ``slowloris`` and ``partial-bodies`` (item 2): HTTP connections that never finish their headers,
  or send all but a few bytes of a declared 1 MiB body (``benchmarks/attacks_http.py``);
- ``push`` (item 3): a PushWeights chunk declaring a huge tensor; the runner's memory is measured
  (``benchmarks/attacks_push.py``).

An attack whose module is missing is reported as skipped. Writes ``benchmarks/results/limits.json``;
``docs/benchmarks.md`` ("Resource bounds") records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import importlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from benchmarks.bench import summary
from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import ServiceProcess, free_port, start_runner, start_worker, wait_until

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1024**2
SETTLE_S = 2.0  # after an attack, before the "after" reading: late frees and trims land
PROBE = worker_pb2.GenerateRequest(prompt="a probe", num_inference_steps=2, width=64, height=64,
                                   output_format=worker_pb2.OUTPUT_FORMAT_RAW)


def status_mb(pid: int, field: str) -> float:
    """``VmRSS``, ``VmHWM``... of process ``pid``, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_rss_mb(pid: int) -> float:
    """Process ``pid``'s peak RSS so far, in MiB: the larger of ``VmHWM`` and ``VmRSS``, because the
    kernel folds its per-thread RSS counters into the high-water mark lazily, so ``VmHWM`` can read
    a little below a ``VmRSS`` read just before it."""
    return max(status_mb(pid, "VmHWM"), status_mb(pid, "VmRSS"))


@contextmanager
def peak_memory(pid: int) -> Iterator[dict[str, float]]:
    """Yields a dict that holds ``peak_mb`` once the block ends: the larger of ``VmHWM`` (reset at
    the start through ``clear_refs`` where the kernel lets us) and a 20 ms poll of ``VmRSS``."""
    result: dict[str, float] = {}
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    polled = [status_mb(pid, "VmRSS")]
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.02):
            polled.append(status_mb(pid, "VmRSS"))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield result
    finally:
        done.set()
        poller.join()
        result["peak_mb"] = max(max(polled), status_mb(pid, "VmHWM") if hwm_reset else 0.0)


@contextmanager
def prober(target: str) -> Iterator[dict[str, Any]]:
    """Calls Generate and the health Check in turn, on a channel of their own, until the block
    ends; the dict yielded then holds, for each, how many succeeded and their latency in ms."""
    outcomes: dict[str, list[tuple[bool, float]]] = {"generate": [], "health": []}
    done = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            calls: dict[str, Callable[[], object]] = {
                "health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5),
                "generate": lambda: stub.Generate(PROBE, timeout=60)}
            while not done.is_set():
                for name, call in calls.items():
                    started = time.perf_counter()
                    try:
                        call()
                        ok = True
                    except grpc.RpcError:
                        ok = False
                    outcomes[name].append((ok, (time.perf_counter() - started) * 1000))

    result: dict[str, Any] = {}
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()
        for name, calls in outcomes.items():
            result[name] = {"ok": sum(ok for ok, _ in calls), "calls": len(calls),
                            "ms": summary([ms for _, ms in calls])}


def noise_png(size: int) -> bytes:
    """A PNG of random pixels: as large as a ``size`` x ``size`` RGB image gets (no compression helps)."""
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()


async def image_flood(target: str, count: int, channels: int, picture: bytes) -> dict[str, int]:
    """``count`` concurrent Generates with ``picture`` resized to 64 x 64, over ``channels``
    connections; how many ended with each status."""
    request = worker_pb2.GenerateRequest(prompt="a flood", image=picture, width=64, height=64, strength=0.5,
                                         resize_mode=worker_pb2.RESIZE_MODE_RESIZE, num_inference_steps=2,
                                         output_format=worker_pb2.OUTPUT_FORMAT_RAW)
    opened = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    stubs = [worker_pb2_grpc.WorkerServiceStub(channel) for channel in opened]

    async def one(index: int) -> str:
        try:
            await stubs[index % channels].Generate(request, timeout=300)
            return "OK"
        except grpc.aio.AioRpcError as error:
            return error.code().name

    try:
        return dict(collections.Counter(await asyncio.gather(*(one(i) for i in range(count)))))
    finally:
        for channel in opened:
            await channel.close()


def attack_module(name: str) -> ModuleType | None:
    """``benchmarks.<name>``, or None while it is not written yet."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError:
        return None


def measure(process: ServiceProcess, target: str, attack: Callable[[], object]) -> dict[str, Any]:
    """``process``'s memory before, during and after ``attack()``, with the prober running alongside."""
    idle = status_mb(process.pid, "VmRSS")
    started = time.perf_counter()
    with peak_memory(process.pid) as memory, prober(target) as answered:
        outcome = attack()
    elapsed = time.perf_counter() - started
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        wait_until(lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10).queue_depth == 0, 300,
                   "an empty queue")
    time.sleep(SETTLE_S)
    return {"outcome": outcome, "seconds": elapsed, "idle_mb": idle, "peak_mb": memory["peak_mb"],
            "after_mb": status_mb(process.pid, "VmRSS"), "probes": answered}


def held(context: Callable[[], AbstractContextManager[object]], seconds: float) -> Callable[[], object]:
    """An attack that holds ``context`` open for ``seconds``."""
    def attack() -> str:
        with context():
            time.sleep(seconds)
        return f"held {seconds:g} s"
    return attack


def run(args: argparse.Namespace, worker: ServiceProcess, runner: ServiceProcess) -> dict[str, Any]:
    host, http_port = "127.0.0.1", worker.extra["http_port"]
    results: dict[str, Any] = {}
    if "images" in args.attacks:
        picture = noise_png(args.image_size)
        results["images"] = {"requests": args.images, "image_bytes": len(picture), **measure(
            worker, worker.target, lambda: asyncio.run(image_flood(worker.target, args.images, args.channels,
                                                                   picture)))}
    http = attack_module("attacks_http")
    # attacks_http.slowloris(host, port, connections), .partial_bodies(host, port, connections, declared_bytes)
    for name, function, extra in (("slowloris", "slowloris", (args.slowloris,)),
                                  ("partial-bodies", "partial_bodies", (args.partial_bodies, MB))):
        if name not in args.attacks:
            continue
        if http is None:
            results[name] = {"skipped": "benchmarks/attacks_http.py is not there yet"}
            continue
        context = functools.partial(getattr(http, function), host, http_port, *extra)
        results[name] = {"connections": extra[0], **measure(worker, worker.target, held(context, args.hold_s))}
    if "push" in args.attacks:
        push = attack_module("attacks_push")
        if push is None:
            results["push"] = {"skipped": "benchmarks/attacks_push.py is not there yet"}
        else:
            shape = [1024, 1024, 1024]
            results["push"] = {"declared_shape": shape, **measure(
                runner, worker.target, lambda: str(push.oversized_declaration(worker.target, shape)))}
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"{'attack':<16}{'outcome':<44}{'idle':>8}{'peak':>8}{'after':>8}  probes: generate ok, p50 / p99 ms; "
          "health ok, p50 / p99 ms")
    for name, result in results.items():
        if "skipped" in result:
            print(f"{name:<16}skipped: {result['skipped']}")
            continue
        probes = result["probes"]
        answered = "; ".join(f"{probes[k]['ok']}/{probes[k]['calls']}, {probes[k]['ms']['p50']:.0f} / "
                             f"{probes[k]['ms']['p99']:.0f}" for k in ("generate", "health"))
        print(f"{name:<16}{str(result['outcome'])[:43]:<44}{result['idle_mb']:>8.0f}{result['peak_mb']:>8.0f}"
              f"{result['after_mb']:>8.0f}  {answered}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", nargs="+", default=["images", "slowloris", "partial-bodies", "push"],
                        choices=["images", "slowloris", "partial-bodies", "push"])
    parser.add_argument("--images", type=int, default=200, help="concurrent image requests")
    parser.add_argument("--image-size", type=int, default=2048, help="side of each noise PNG")
    parser.add_argument("--channels", type=int, default=8, help="connections the image requests share")
    parser.add_argument("--slowloris", type=int, default=2000, help="HTTP connections that never finish headers")
    parser.add_argument("--partial-bodies", type=int, default=800, help="HTTP connections with a 1 MiB body cut short")
    parser.add_argument("--hold-s", type=float, default=20.0, help="seconds the HTTP attacks are held")
    parser.add_argument("--worker-arg", action="append", default=[], help="an extra worker flag (repeatable)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    logs = RESULTS / "logs"
    logs.mkdir(exist_ok=True)
    http_port = free_port()
    runner = start_runner(logs)
    worker = start_worker(logs, runner.target, "--model", "tiny", "--http-port", str(http_port), *args.worker_arg)
    worker.extra["http_port"] = http_port
    try:
        with grpc.insecure_channel(worker.target) as channel:  # the first run of a fresh runner is slow
            worker_pb2_grpc.WorkerServiceStub(channel).Generate(PROBE, timeout=120)
        results = run(args, worker, runner)
    finally:
        worker.stop()
        runner.stop()
    (RESULTS / "limits.json").write_text(json.dumps(results, indent=1))
    print_table(results)


if __name__ == "__main__":
    main()
