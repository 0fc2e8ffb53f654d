"""What an exact repeat costs when the result cache answers it, against generating it (issue 41 item 5).

``python -m benchmarks.bench_result_cache [--model tiny] [--size 64] [--steps 20] [--prompts 16]``
starts a runner and a worker on loopback, the worker with ``--result-cache-bytes`` (64 MiB), warms
them with one request, then for each of PROMPTS distinct prompts (so that every first call misses)
sends a seeded PNG request and the same request again under a new request id, one at a time, and
prints as JSON:

- ``miss_ms`` and ``hit_ms``: the median Generate call, as the client times it, of the first calls
  (generated) and of the repeats (answered from memory), with their ``..._p90_ms``;
- ``hit_worker_ms``: the median ``timings.total_ms`` of the repeats, the worker's own time for a hit
  (validation, the key, the lookup);
- ``hit_share``: hit_ms / miss_ms (the target is below 0.05);
- ``hits_identical``: whether every repeat returned the first call's bytes and reported itself a hit
  (``execute_ms`` 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from diffusion.v1 import worker_pb2
from harness.processes import start_runner, start_worker, worker_stub
from worker_service.result_cache import answered_from_memory

CACHE_BYTES = 64 * 1024**2


def _request(prompt: str, size: int, steps: int, number: int, take: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=f"bench-{number}-{take}", prompt=prompt, width=size, height=size,
                                      num_inference_steps=steps, seed=1000 + number,
                                      output_format=worker_pb2.OUTPUT_FORMAT_PNG)


def _timed(stub, request: worker_pb2.GenerateRequest) -> tuple[float, worker_pb2.GenerateResponse]:
    began = time.perf_counter()
    response = stub.Generate(request, timeout=600)
    return (time.perf_counter() - began) * 1000, response


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def measure(model: str, size: int, steps: int, prompts: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as logs:
        log_dir = Path(logs)
        runner = start_runner(log_dir)
        worker = start_worker(log_dir, runner.target, "--model", model, "--result-cache-bytes", str(CACHE_BYTES))
        try:
            with worker_stub(worker.target) as stub:
                stub.Generate(_request("a warm-up", size, steps, -1, 0), timeout=600)
                misses: list[float] = []
                hits: list[float] = []
                hit_worker: list[float] = []
                identical = True
                for number in range(prompts):
                    prompt = f"a lighthouse on a cliff at dusk, scene {number}"
                    miss_ms, first = _timed(stub, _request(prompt, size, steps, number, 0))
                    hit_ms, again = _timed(stub, _request(prompt, size, steps, number, 1))
                    misses.append(miss_ms)
                    hits.append(hit_ms)
                    hit_worker.append(again.timings.total_ms)
                    identical &= (answered_from_memory(again) and not answered_from_memory(first)
                                  and [i.data for i in again.images] == [i.data for i in first.images])
        finally:
            worker.stop()
            runner.stop()
    miss, hit = statistics.median(misses), statistics.median(hits)
    return {"model": model, "size": size, "steps": steps, "prompts": prompts,
            "miss_ms": round(miss, 2), "miss_p90_ms": round(_p90(misses), 2),
            "hit_ms": round(hit, 3), "hit_p90_ms": round(_p90(hits), 3),
            "hit_worker_ms": round(statistics.median(hit_worker), 3),
            "hit_share": round(hit / miss, 4), "hits_identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description="An exact repeat from the result cache against generating it.")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.size, args.steps, args.prompts)))


if __name__ == "__main__":
    main()
