"""On a machine with a CUDA GPU: the CUDA platform, sleep levels 1 and 2, and the hop overhead.

Prints its figures and exits non-zero when a check fails. ``benchmarks/gpu_check.sh`` runs it, as
``python -m benchmarks.gpu_check`` from the repository root (it imports ``benchmarks.bench``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import torch

from benchmarks.bench import InProcess, bench_hop
from clients import DiffusionClient
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from harness.processes import start_runner, start_worker
from runner_service.models.catalog import ensure_builtin


def runner_stub(target: str) -> runner_pb2_grpc.RunnerServiceStub:
    return runner_pb2_grpc.RunnerServiceStub(grpc.insecure_channel(target))


def info(stub: runner_pb2_grpc.RunnerServiceStub) -> common_pb2.RunnerInfo:
    return stub.GetInfo(runner_pb2.GetInfoRequest()).info


def generate(stub: runner_pb2_grpc.RunnerServiceStub, seed: int, steps: int, size: int) -> np.ndarray:
    """One image straight from the runner's Execute, as an HxWxC uint8 array."""
    item = runner_pb2.ExecuteItem(request_id=f"gpu-check-{seed}", prompt="a red fox", width=size, height=size,
                                  num_inference_steps=steps, guidance_scale=7.5, seed=seed, num_images=1)
    events = list(stub.Execute(runner_pb2.ExecuteRequest(items=[item])))
    assert events[-1].HasField("result"), events[-1]
    raw = events[-1].result.outputs[0].images[0]
    return np.frombuffer(raw.pixels, dtype=np.uint8).reshape(raw.height, raw.width, raw.channels)


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    failures = []
    logs = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runner = start_runner(logs, "--device", "auto")
    try:
        runner_info = info(runner_stub(runner.target))
        print(f"platform {runner_info.platform}, device {runner_info.device_name}")
        if runner_info.platform != "cuda":
            failures.append("auto did not select cuda")
        stub = runner_stub(runner.target)
        stub.LoadModel(runner_pb2.LoadModelRequest(source="small"))
        reference = generate(stub, seed=3, steps=10, size=128)
        for level in (1, 2):
            slept = stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=level))
            share = slept.freed_bytes / slept.weight_bytes_released
            print(f"sleep level {level}: weights {slept.weight_bytes_released} B, "
                  f"mem_get_info freed {slept.freed_bytes} B ({share:.0%})")
            if share < 0.9:
                failures.append(f"level {level} freed {share:.0%} < 90% of the weights")
            stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
            same = np.array_equal(generate(stub, seed=3, steps=10, size=128), reference)
            print(f"  identical after wake: {same}")
            if not same:
                failures.append(f"level {level}: output changed after wake")
        worker = start_worker(logs, runner.target, "--model", "small", "--dtype", "float16")
        local = InProcess(ensure_builtin("small"), device="cuda", dtype=torch.float16)
        with DiffusionClient(worker.target) as client:
            hop = bench_hop(client, local, _Args())
        print(f"hop: service median {hop['service_ms']['p50']:.1f} ms, in-process {hop['inprocess_ms']['p50']:.1f} ms,"
              f" ratio {hop['median_ratio']:.4f}")
        worker.stop()
    except grpc.RpcError as error:
        failures.append(f"{error.code().name}: {error.details()}")
    finally:
        runner.stop()
    print("FAILED: " + "; ".join(failures) if failures else "all GPU checks passed")
    return 1 if failures else 0


class _Args:
    size, steps, repeats = 512, 20, 10


if __name__ == "__main__":
    sys.exit(main())
