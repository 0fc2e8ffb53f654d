"""``python -m benchmarks.bench_group``: a runner group's served latency on the CPU (issue 27) against
one runner and against two replicas, side by side in one run.

A group runs each request as one pipeline call over its ranks, so its baselines are runners that do
the same (``--batching request``). Every system serves one Flux model through a worker, with the
same requests (request i: ``bench.prompt_for(i)``, seed i):

- **latency**, one client, N sequential requests after a warm-up, each system's p50:
  (a) ``one_runner_2_threads``: one runner ``--threads 2``, the whole of a 2-core machine;
  (b) ``one_runner_1_thread``: one runner ``--threads 1``, what one rank of the group has;
  (c) ``group_cfg``: ``--devices 2 --threads 1`` with CFG-parallel, on guided requests (a negative
  prompt and ``true_cfg_scale`` 3: both branches run each step, one per rank);
  (d) ``group_ulysses``: the same group with Ulysses-2 (the sequence split over the ranks), on
  guided and unguided requests. (a) and (b) serve both kinds, so every p50 has its ratio to (a)
  and to (b) for the same kind of request.
- **throughput**, two clients sending guided requests at once: ``replicas`` (two runners
  ``--threads 1`` behind one worker, ``--runner`` twice) against each group mode, in requests/s:
  the same two cores spent on two requests at a time or on one request at a time twice as fast.

The worker sends one request per Execute (``--max-batch-size 1``) everywhere, so each request is one
pipeline call on every system and the replicas' two requests never merge into one batch.

The model is diffusers' tiny Flux config (``families.flux.tiny.build_flux``, its text encoders and VAE)
with a larger transformer (``--layers``, ``--single-layers``, ``--heads``, ``--head-dim``) and
prompts of ``--text-tokens`` T5 tokens, saved with ``save_pretrained`` and loaded by path
(``--model-root``), so the transformer's compute dominates as in a real Flux; with the defaults a
request takes about 1.5 s (unguided) to 3 s (guided) on one 2-thread runner of a quiet 2-core
machine. Each system runs alone on the machine (start, measure, stop, then the next), every system
once per round; a system measured for both latency and throughput (the two group modes) is started
once a round for both. A system's figure is its best of ``--rounds`` rounds, which keeps a load
from other processes in one round out of the comparison. Writes ``benchmarks/results/group.json``
(``--output``) and prints the figures; ``docs/benchmarks.md`` records a run.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from benchmarks.bench import RESULTS, new_results, prompt_for, summary, write_results
from clients import DiffusionClient
from diffusion.v1 import common_pb2
from harness.processes import start_runner, start_worker
from runner_service.families.flux.tiny import build_flux
from runner_service.families.seeded import seeded

GUIDED = {"negative_prompt": "blurry", "true_cfg_scale": 3.0}  # true CFG: both branches every step
KINDS = {"guided": GUIDED, "unguided": {}}
ONE_RUNNER = ("--batching", "request")
GROUP = ("--devices", "2", "--threads", "1")
# Request i's seed and prompt index in the throughput runs start here, apart from the latency runs'.
THROUGHPUT_OFFSET = 1_000
WARM_OFFSET = 10_000


@dataclass(frozen=True)
class System:
    """A served system: each runner's flags, the worker's own flags, the parallel plan its runner
    must report once loaded (checked, so a flag the worker ignored cannot pass for a group), and the
    kinds of request it is measured on."""

    name: str
    runners: tuple[tuple[str, ...], ...]
    worker: tuple[str, ...]
    plan: common_pb2.Parallelism
    kinds: tuple[str, ...]


NO_PLAN = common_pb2.Parallelism()
CFG_PLAN = common_pb2.Parallelism(cfg=True)
ULYSSES_PLAN = common_pb2.Parallelism(ulysses_degree=2)
LATENCY = (
    System("one_runner_2_threads", ((*ONE_RUNNER, "--threads", "2"),), (), NO_PLAN, ("guided", "unguided")),
    System("one_runner_1_thread", ((*ONE_RUNNER, "--threads", "1"),), (), NO_PLAN, ("guided", "unguided")),
    System("group_cfg", (GROUP,), ("--cfg-parallel",), CFG_PLAN, ("guided",)),
    System("group_ulysses", (GROUP,), ("--ulysses-degree", "2"), ULYSSES_PLAN, ("guided", "unguided")),
)
THROUGHPUT = (
    System("replicas", ((*ONE_RUNNER, "--threads", "1"),) * 2, (), NO_PLAN, ("guided",)),
    System("group_cfg", (GROUP,), ("--cfg-parallel",), CFG_PLAN, ("guided",)),
    System("group_ulysses", (GROUP,), ("--ulysses-degree", "2"), ULYSSES_PLAN, ("guided",)),
)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux's rotary axes (index, height, width) summing to ``head_dim``, each even, in FLUX.1's
    proportions (16, 56, 56 of 128) as near as even sizes allow."""
    side = head_dim * 7 // 16 // 2 * 2
    return head_dim - 2 * side, side, side


def build_model(directory: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """Tiny Flux with a transformer of the asked size, saved under ``directory``; its path and the
    transformer's parameter count."""
    base = build_flux()
    # The runner reads as many T5 tokens as the tokenizer's length (``max_sequence_length``): set
    # so the image's tokens dominate the joint sequence, as FLUX.1's 4096 do its 512.
    base.tokenizer_2.model_max_length = args.text_tokens
    transformer = seeded(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=args.layers, num_single_layers=args.single_layers,
        attention_head_dim=args.head_dim, num_attention_heads=args.heads, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=rope_axes(args.head_dim)))
    pipeline = FluxPipeline(**{**base.components, "transformer": transformer})
    path = directory / "flux-bench"
    pipeline.save_pretrained(path)
    return path, sum(parameter.numel() for parameter in transformer.parameters())


@contextmanager
def serving(system: System, model: Path, log_dir: Path) -> Iterator[str]:
    """``system``'s runners and its worker with ``model`` loaded (and its plan confirmed); the
    worker's target. Everything is stopped on leaving, so the next system has the machine alone."""
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(system.runners)) as pool:  # side by side: a start is mostly imports
            starts = [pool.submit(start_runner, log_dir, "--model-root", str(model.parent), *flags)
                      for flags in system.runners]
        for start in starts:
            if start.exception() is None:
                stack.callback(start.result().stop)
        targets = [start.result().target for start in starts]  # raises the first failure
        extra = [argument for target in targets[1:] for argument in ("--runner", target)]
        worker = start_worker(log_dir, targets[0], *extra, "--model", str(model), "--max-batch-size", "1",
                              *system.worker)
        stack.callback(worker.stop)
        with DiffusionClient(worker.target) as client:
            for runner_status in client.status(timeout=30).runners:
                if runner_status.info.model.parallel != system.plan:
                    raise RuntimeError(f"{system.name}: the runner reports parallel "
                                       f"{runner_status.info.model.parallel}, not {system.plan}")
        yield worker.target


def generate(client: DiffusionClient, index: int, kind: str, args: argparse.Namespace) -> float:
    """Request ``index`` of ``kind``, served; its wall time in ms."""
    started = time.perf_counter()
    result = client.generate(prompt_for(index), width=args.size, height=args.size, steps=args.steps, seed=index,
                             timeout=600, **KINDS[kind])
    elapsed = (time.perf_counter() - started) * 1000
    if len(result.images) != 1:
        raise RuntimeError(f"request {index}: {len(result.images)} images, not 1")
    return elapsed


def latency_round(system: System, target: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """One round of ``system`` served at ``target``: a warm-up request of each kind (a fresh
    process's first call is slow), then ``--requests`` sequential requests of each kind; each
    request's ms by kind."""
    with DiffusionClient(target) as client:
        for kind in system.kinds:
            generate(client, WARM_OFFSET, kind, args)
        return {kind: [generate(client, index, kind, args) for index in range(args.requests)]
                for kind in system.kinds}


def throughput_round(target: str, args: argparse.Namespace) -> dict[str, float]:
    """One round of the system served at ``target`` under two clients, each sending
    ``--throughput-requests`` guided requests one after another, both starting together after a
    warm-up of two at once (which reaches both replicas); all requests over the wall time from the
    start to the last one's end."""
    clients = 2
    start = threading.Barrier(clients)

    def client_loop(number: int, first: int, count: int) -> float:
        """Client ``number``: ``count`` requests from index ``first + number`` in steps of two;
        the time it finished."""
        with DiffusionClient(target) as client:
            start.wait(60)
            for index in range(first + number, first + number + clients * count, clients):
                generate(client, index, "guided", args)
        return time.perf_counter()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients), [WARM_OFFSET] * clients, [1] * clients))
        started = time.perf_counter()
        ends = list(pool.map(client_loop, range(clients), [THROUGHPUT_OFFSET] * clients,
                             [args.throughput_requests] * clients))
    seconds = max(ends) - started
    requests = clients * args.throughput_requests
    return {"requests": requests, "seconds": seconds, "requests_per_s": requests / seconds}


def systems() -> list[tuple[System, bool, bool]]:
    """Every system to serve in a round, in order, each with whether it is measured for latency (it
    is then its LATENCY entry, with the kinds measured) and for throughput. A system in both is
    served the same way for both (checked), so it is started once for both."""
    served: dict[str, tuple[System, bool, bool]] = {system.name: (system, True, False) for system in LATENCY}
    for system in THROUGHPUT:
        if system.name not in served:
            served[system.name] = (system, False, True)
            continue
        measured = served[system.name][0]
        if (measured.runners, measured.worker, measured.plan) != (system.runners, system.worker, system.plan):
            raise ValueError(f"{system.name} is served two ways")
        served[system.name] = (measured, True, True)
    return list(served.values())


def latency_figures(rounds: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Each system's and kind's rounds, its best p50 and that p50's ratio to (a)'s and (b)'s best of
    the same kind."""
    best = {name: {kind: min(summary_["p50"] for summary_ in kinds[kind]) for kind in kinds}
            for name, kinds in rounds.items()}
    one_2, one_1 = LATENCY[0].name, LATENCY[1].name
    return {name: {kind: {"rounds": kinds[kind], "best_p50_ms": best[name][kind],
                          f"to_{one_2}": best[name][kind] / best[one_2][kind],
                          f"to_{one_1}": best[name][kind] / best[one_1][kind]}
                   for kind in kinds}
            for name, kinds in rounds.items()}


def throughput_figures(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each system's rounds, its best requests/s and that figure's ratio to the replicas' best."""
    best = {name: max(run["requests_per_s"] for run in runs) for name, runs in rounds.items()}
    replicas = THROUGHPUT[0].name
    return {name: {"rounds": runs, "best_requests_per_s": best[name], f"to_{replicas}": best[name] / best[replicas]}
            for name, runs in rounds.items()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--layers", type=int, default=1, help="the transformer's double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=2, help="its single-stream blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (Ulysses-2 needs an even count)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=128, help="T5 tokens each prompt is padded to")
    parser.add_argument("--size", type=int, default=64, help="width and height of every image")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="sequential requests of each kind per round")
    parser.add_argument("--throughput-requests", type=int, default=4, help="requests per client per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every system; each figure is the best")
    parser.add_argument("--output", type=Path, default=RESULTS / "group.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    diffusers.utils.logging.set_verbosity_error()
    args = parse(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-group-"))
    results = new_results(args)
    model, parameters = build_model(log_dir, args)
    results["model"] = {"transformer_parameters": parameters}
    latency: dict[str, dict[str, list[dict[str, float]]]] = {
        system.name: {kind: [] for kind in system.kinds} for system in LATENCY}
    throughput: dict[str, list[dict[str, float]]] = {system.name: [] for system in THROUGHPUT}
    for _ in range(args.rounds):
        for system, for_latency, for_throughput in systems():
            with serving(system, model, log_dir) as target:
                if for_latency:
                    for kind, times in latency_round(system, target, args).items():
                        latency[system.name][kind].append(summary(times))
                if for_throughput:
                    throughput[system.name].append(throughput_round(target, args))
    results["latency"] = latency_figures(latency)
    results["throughput"] = throughput_figures(throughput)
    return write_results(results, args.output, print_table)


def print_table(results: dict[str, Any]) -> None:
    one_2, one_1 = LATENCY[0].name, LATENCY[1].name
    print(f"{'latency, 1 client':<34} {'best p50 ms':>12} {'/ (a) 2 threads':>16} {'/ (b) 1 thread':>15}")
    for name, kinds in results["latency"].items():
        for kind, figures in kinds.items():
            print(f"{name + ', ' + kind:<34} {figures['best_p50_ms']:>12.1f} {figures[f'to_{one_2}']:>16.3f} "
                  f"{figures[f'to_{one_1}']:>15.3f}")
    replicas = THROUGHPUT[0].name
    print(f"{'throughput, 2 clients, guided':<34} {'requests/s':>12} {'/ replicas':>16}")
    for name, figures in results["throughput"].items():
        print(f"{name:<34} {figures['best_requests_per_s']:>12.3f} {figures[f'to_{replicas}']:>16.3f}")
    print(f"load average before {results['machine']['load_average']}, after "
          f"{results['machine']['load_average_after']}")


if __name__ == "__main__":
    main()
