"""The worst case of work bounded by its deadline (issue 35 item 1), served with default flags.

``python -m benchmarks.bench_deadline [--model tiny-flux] [--deadline 90]`` starts a runner and a
worker on loopback with their defaults (so the runner's platform chooses ``--max-size``), and
prints as JSON:

- ``max_size``: the largest side the model is served at by default (ModelInfo.max_size);
- ``largest_admitted_steps``: once two images of that size have run (so its cost is measured, not
  extrapolated from the sizes measured at load), the most steps of one max_size x max_size image the worker admits
  with DEADLINE seconds left (a bisection over refusals, each admitted probe cancelled at once);
- ``refusal``: what the worker answers one step beyond it;
- ``idle_after_cancel_s``: each admitted probe is cancelled after its first step; how long the
  runner's device stayed busy after each cancel;
- the largest admitted request then runs with that deadline: ``deadline_exceeded_after_s`` (when
  the client's call ended), ``idle_after_deadline_s`` (how long after it the runner reported its
  device idle: ``RunnerInfo.device_busy_s`` 0) and ``step_ms`` (the runner's measured step at that
  size), so the overrun reads against one step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import grpc

from diffusion.v1 import runner_pb2, runner_pb2_grpc, worker_pb2
from harness.processes import start_runner, start_worker, wait_until, worker_stub


def _request(size: int, steps: int, seed: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt=f"a lighthouse at dusk, take {seed}", width=size, height=size,
                                      num_inference_steps=steps, seed=seed,
                                      output_format=worker_pb2.OUTPUT_FORMAT_RAW)


def _admitted(stub, runner, size: int, steps: int, deadline: float, stops: list[float]) -> str | None:
    """None when the worker takes the request, else the refusal. A request taken is cancelled after
    its first denoising step, and ``stops`` gets how long the runner took to be idle after that."""
    stream = stub.GenerateStream(worker_pb2.GenerateStreamRequest(request=_request(size, steps, steps)),
                                 timeout=deadline)
    try:
        for event in stream:
            if event.HasField("progress"):
                break
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    cancelled = time.monotonic()
    stream.cancel()
    stops.append(_wait_idle(runner) - cancelled)
    return None


def _busy(runner) -> float:
    info: runner_pb2.GetInfoResponse = runner.GetInfo(runner_pb2.GetInfoRequest(), timeout=10)
    return info.info.device_busy_s


def _wait_idle(runner) -> float:
    wait_until(lambda: _busy(runner) == 0, 3600, "the runner's device idle", interval=0.01)
    return time.monotonic()


def measure(model: str, deadline: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as logs:
        log_dir = Path(logs)
        runner_process = start_runner(log_dir, "--model", model)
        worker_process = start_worker(log_dir, runner_process.target)
        try:
            runner = runner_pb2_grpc.RunnerServiceStub(grpc.insecure_channel(runner_process.target))
            model_info = runner.GetInfo(runner_pb2.GetInfoRequest(), timeout=10).info.model
            size = model_info.max_size
            with worker_stub(worker_process.target) as stub:
                for seed in range(2):  # the runner measures this size's cost past its first, slower, step
                    stub.Generate(_request(size, 8, seed), timeout=600)
                stops: list[float] = []
                low, high = 0, 500
                while low < high:  # the most steps admitted: admitted(low), refused(high + 1)
                    middle = (low + high + 1) // 2
                    if _admitted(stub, runner, size, middle, deadline, stops) is None:
                        low = middle
                    else:
                        high = middle - 1
                refusal = _admitted(stub, runner, size, low + 1, deadline, stops) if low < 500 else None
                result: dict[str, object] = {"model": model, "deadline_s": deadline, "max_size": size,
                                             "largest_admitted_steps": low, "refusal": refusal,
                                             "idle_after_cancel_s": [round(stop, 2) for stop in stops]}
                if low == 0:
                    return result
                began = time.monotonic()
                try:
                    stub.Generate(_request(size, low, 7), timeout=deadline)
                    result["finished_within_deadline"] = True
                    ended = time.monotonic()
                except grpc.RpcError as error:
                    ended = time.monotonic()
                    result["code"] = error.code().name
                idle = _wait_idle(runner)
                costs = runner.GetInfo(runner_pb2.GetInfoRequest(), timeout=10).info.model.costs
                point = min(costs, key=lambda cost: abs(cost.pixels - size * size))
                result.update(deadline_exceeded_after_s=round(ended - began, 2),
                              idle_after_deadline_s=round(idle - ended, 2), step_ms=round(point.step_ms, 1),
                              decode_ms=round(point.decode_ms, 1))
                return result
        finally:
            worker_process.stop()
            runner_process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--deadline", type=float, default=90.0, help="the client's timeout, seconds")
    arguments = parser.parse_args()
    print(json.dumps(measure(arguments.model, arguments.deadline), indent=2))


if __name__ == "__main__":
    main()
