"""``make bench`` (weights part): PushWeights bandwidth against a plain gRPC byte stream of the same
size on the same loopback, and the cost of switching LoRA adapters between batches.

Both are ratios or differences measured side by side in one run, interleaved: each PushWeights
round (client -> worker -> runner, checked, kept on disk and applied) is followed by a round of
the same bytes, in chunks of the same size, streamed to a server that only counts them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file

from clients import DiffusionClient
from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness.processes import REPO, free_port, start_runner, start_worker, wait_until
from runner_service.models.catalog import ensure_builtin
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES
from serving_common.server import EXCLUSIVE_PORT
from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES

RESULTS = Path(__file__).resolve().parent / "results"
SINK_METHOD = "/bench.ByteSink/Consume"
# A server with one client-streaming method that counts the bytes it is sent: the loopback's limit.
SINK_SERVER = f"""
import sys, grpc
from concurrent import futures
def consume(requests, context):
    return str(sum(len(r) for r in requests)).encode()
options = [("grpc.max_receive_message_length", {DEFAULT_MAX_MESSAGE_BYTES}), {EXCLUSIVE_PORT}]
server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "bench.ByteSink", {{"Consume": grpc.stream_unary_rpc_method_handler(consume)}})])
server.add_insecure_port(sys.argv[1]); server.start(); print("ready", flush=True); server.wait_for_termination()
"""


def model_tensors(model: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's UNet as its file holds it, named for PushWeights."""
    tensors = load_file(ensure_builtin(model) / "unet" / "diffusion_pytorch_model.safetensors")
    return {f"unet.{name}": tensor.contiguous() for name, tensor in sorted(tensors.items())}


def plain_stream(channel: grpc.Channel, total: int) -> float:
    chunk = b"\x5a" * DEFAULT_CHUNK_BYTES
    sizes = [DEFAULT_CHUNK_BYTES] * (total // DEFAULT_CHUNK_BYTES) + ([total % DEFAULT_CHUNK_BYTES] if total %
                                                                        DEFAULT_CHUNK_BYTES else [])
    consume = channel.stream_unary(SINK_METHOD)
    started = time.perf_counter()
    counted = int(consume(iter(chunk[:size] for size in sizes), timeout=600))
    elapsed = time.perf_counter() - started
    assert counted == total, (counted, total)
    return elapsed


def sha256_seconds(tensors: dict[str, torch.Tensor]) -> float:
    """One sha256 over every tensor's bytes, on one core: the digest a push must compute at least
    once end to end (the client's commit; the runner checks it again), however the bytes travel."""
    started = time.perf_counter()
    digest = hashlib.sha256()
    for tensor in tensors.values():
        digest.update(memoryview(tensor.numpy()).cast("B"))
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_push(client: DiffusionClient, sink: grpc.Channel, model: str, rounds: int,
               pids: dict[str, int]) -> dict:
    """Push then plain stream, ``rounds`` times; beside the times, the CPU each process spent per push
    and per plain stream (``pids``: worker, runner, sink; the client is this process): on 2 cores
    the CPU a push needs in all bounds its time more than any one hop does."""
    tensors = model_tensors(model)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    push_s, plain_s, hash_s = [], [], []
    push_cpu = dict.fromkeys(["client", "worker", "runner"], 0.0)
    plain_cpu = dict.fromkeys(["client", "sink"], 0.0)

    def cpu_now() -> dict[str, float]:
        return {"client": time.process_time(), **{name: cpu_seconds(pid) for name, pid in pids.items()}}

    for _ in range(rounds):
        before, started = cpu_now(), time.perf_counter()
        reply = client.push_weights(tensors, chunk_bytes=DEFAULT_CHUNK_BYTES, timeout=600)
        push_s.append(time.perf_counter() - started)
        after = cpu_now()
        assert reply.bytes_received == total
        for name in push_cpu:
            push_cpu[name] += (after[name] - before[name]) / rounds
        plain_s.append(plain_stream(sink, total))
        streamed = cpu_now()
        for name in plain_cpu:
            plain_cpu[name] += (streamed[name] - after[name]) / rounds
        hash_s.append(sha256_seconds(tensors))
    push, plain, hashed = statistics.median(push_s), statistics.median(plain_s), statistics.median(hash_s)
    # A push cannot end before one sha256 over its bytes has: the best ratio it could reach is
    # plain / sha256, were everything else free and the client's and runner's digests overlapped.
    return {"bytes": total, "tensors": len(tensors), "push_s": push, "plain_s": plain, "sha256_s": hashed,
            "push_mb_s": total / push / 1e6, "plain_mb_s": total / plain / 1e6, "sha256_mb_s": total / hashed / 1e6,
            "ratio": plain / push, "ratio_ceiling": plain / hashed,
            "push_cpu_s": push_cpu, "plain_cpu_s": plain_cpu}


def bench_adapters(stub: worker_pb2_grpc.WorkerServiceStub, lora_dir: Path, rounds: int) -> dict:
    """Per-batch time with the same adapter every time, alternating two, and none."""
    sys.path.insert(0, str(REPO / "tests"))
    from lora_files import make_lora

    for name, seed in (("a", 1), ("b", 2)):
        path = make_lora(lora_dir / f"{name}.safetensors", seed=seed)
        stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=str(path)), timeout=120)

    def batch(adapter: str) -> float:
        refs = [common_pb2.AdapterRef(name=adapter, scale=1.0)] if adapter else []
        started = time.perf_counter()
        stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", num_inference_steps=4, seed=1, adapters=refs),
                      timeout=120)
        return time.perf_counter() - started

    patterns = {"none": ["", ""], "same adapter": ["a", "a"], "alternating adapters": ["a", "b"]}
    times: dict[str, list[float]] = {name: [] for name in patterns}
    for _ in range(rounds):
        for name, sequence in patterns.items():
            for adapter in sequence * 3:
                times[name].append(batch(adapter))
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    return {"batch_ms": medians, "switch_ms": medians["alternating adapters"] - medians["same adapter"],
            "adapter_ms": medians["same adapter"] - medians["none"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--model", default="small", help="the built-in model whose UNet is pushed")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    logs = RESULTS / "logs"
    logs.mkdir(exist_ok=True)
    sink_target = f"127.0.0.1:{free_port()}"
    sink = subprocess.Popen([sys.executable, "-c", SINK_SERVER, sink_target], stdout=subprocess.PIPE, text=True)
    runner = start_runner(logs)
    worker = start_worker(logs, runner.target, "--model", args.model)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        with grpc.insecure_channel(worker.target) as channel, grpc.insecure_channel(sink_target) as sink_channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            wait_until(lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10).state ==
                       worker_pb2.WORKER_STATE_READY, 300, "READY")
            with DiffusionClient(worker.target) as client:
                push = bench_push(client, sink_channel, args.model, args.rounds,
                                  {"worker": worker.pid, "runner": runner.pid, "sink": sink.pid})
            stub.Init(worker_pb2.InitRequest(model="tiny"), timeout=300)
            adapters = bench_adapters(stub, RESULTS / "loras", args.rounds)
    finally:
        worker.stop()
        runner.stop()
        sink.kill()
    results = {"push": push, "adapters": adapters}
    (RESULTS / "weights.json").write_text(json.dumps(results, indent=1))
    print(f"PushWeights of {push['bytes'] / 1e6:.1f} MB ({push['tensors']} tensors): {push['push_s']:.2f} s, "
          f"{push['push_mb_s']:.0f} MB/s; plain gRPC byte stream: {push['plain_s']:.2f} s, "
          f"{push['plain_mb_s']:.0f} MB/s; ratio {push['ratio']:.2f}; one sha256 over the bytes: "
          f"{push['sha256_s']:.3f} s ({push['sha256_mb_s']:.0f} MB/s), so no push here can pass a ratio of "
          f"{push['ratio_ceiling']:.2f}")
    print("CPU per push: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in push["push_cpu_s"].items())
          + "; per plain stream: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in
                                               push["plain_cpu_s"].items()))
    print("adapters, median batch (tiny, 64x64, 4 steps): " + ", ".join(
        f"{name} {ms:.1f} ms" for name, ms in adapters["batch_ms"].items())
          + f"; switching costs {adapters['switch_ms']:.1f} ms per batch")


if __name__ == "__main__":
    main()
