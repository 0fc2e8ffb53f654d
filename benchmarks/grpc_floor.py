"""What gRPC alone costs a served request here: the transport floor under bench_overhead's fixed cost.

A served request crosses two gRPC calls: the client's unary ``Generate`` to the worker, and the
worker's server-streaming ``Execute`` to the runner, each a new call. This module serves the same
two calls with no work behind them, as separate processes on the same loopback with the same
grpc.aio servers and the same blocking client: a "runner" whose streaming method answers one
message of the result's size, and a "worker" whose unary method makes that call on a channel it
opened once and answers the same bytes. The median of many such requests is the least a served
request can cost over an in-process call, whatever the worker and the runner do.

    python -m benchmarks.grpc_floor [--calls 300] [--bytes 12288]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc

from harness.processes import free_port

SERVICE = "bench.Floor"
FIRST_CALLS_DROPPED = 30  # a fresh channel's first calls are slower


async def _serve_runner(target: str, size: int) -> None:
    answer = b"\x5a" * size

    async def execute(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield answer

    await _serve(target, {"Execute": grpc.unary_stream_rpc_method_handler(execute)})


async def _serve_worker(target: str, runner: str) -> None:
    channel = grpc.aio.insecure_channel(runner)
    execute = channel.unary_stream(f"/{SERVICE}/Execute")

    async def generate(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"".join([response async for response in execute(request)])

    await _serve(target, {"Generate": grpc.unary_unary_rpc_method_handler(generate)})


async def _serve(target: str, methods: dict[str, grpc.RpcMethodHandler]) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
    server.add_insecure_port(target)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


@contextmanager
def _server(*args: str) -> Iterator[None]:
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor", *args], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready", args
        yield
    finally:
        process.kill()
        process.wait()


def measure(calls: int, size: int) -> dict[str, float]:
    """Medians (ms) of ``calls`` requests through both hops, and of the runner's hop alone, made with
    a blocking client as bench_overhead's client makes them."""
    runner, worker = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    request = b"\x01" * 200  # about a GenerateRequest's size
    with _server("runner", runner, str(size)), _server("worker", worker, runner), \
            grpc.insecure_channel(worker) as to_worker, grpc.insecure_channel(runner) as to_runner:
        generate = to_worker.unary_unary(f"/{SERVICE}/Generate")
        execute = to_runner.unary_stream(f"/{SERVICE}/Execute")
        both: list[float] = []
        one: list[float] = []
        for _ in range(calls + FIRST_CALLS_DROPPED):
            started = time.perf_counter()
            assert len(generate(request, timeout=30)) == size
            both.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            assert sum(len(response) for response in execute(request, timeout=30)) == size
            one.append((time.perf_counter() - started) * 1000)
    return {"two_hops_ms": statistics.median(both[FIRST_CALLS_DROPPED:]),
            "runner_hop_ms": statistics.median(one[FIRST_CALLS_DROPPED:])}


def main() -> None:
    if sys.argv[1:2] == ["runner"]:
        asyncio.run(_serve_runner(sys.argv[2], int(sys.argv[3])))
        return
    if sys.argv[1:2] == ["worker"]:
        asyncio.run(_serve_worker(sys.argv[2], sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=64 * 64 * 3, help="the answer's size (a raw 64 x 64 image)")
    args = parser.parse_args()
    floor = measure(args.calls, args.bytes)
    print(f"two empty gRPC hops (client -> worker unary, worker -> runner streaming): {floor['two_hops_ms']:.3f} ms; "
          f"the runner's hop alone: {floor['runner_hop_ms']:.3f} ms (medians of {args.calls})")


if __name__ == "__main__":
    main()
