"""Prompt adherence of the built-in ``shapes`` model: for random prompts, the share of images whose
object colour, background colour, shape and position the checker (``shapes_scenes.read_back``,
pixel statistics, no model) reads back as asked.

    python -m benchmarks.bench_shapes --count 200

The same prompts and seeds (image i seeded i) go three ways: in-process through
``FluxPipeline.__call__`` (the reference), then served, by one runner and one worker with
``--max-batch-size 8`` and 8 concurrent clients, once with the runner's ``--batching step`` and
once with ``--batching request``. Each path runs alone on the machine (the in-process pipeline is
released before the first server starts; each server is stopped before the next). A batch must not
lower prompt adherence, so for each served path it also counts the images whose reading differs
from the in-process image's, and the largest pixel difference to it. Writes
``benchmarks/results/shapes.json``, prints a table, and exits 1 when a path misses a target
(``TARGETS``) or a served path's share is below the in-process one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from benchmarks.bench import RESULTS
from clients import DiffusionClient
from harness.processes import REPO, start_runner, start_worker
from runner_service.denoising.loop import max_sequence_length
from runner_service.models.shapes_scenes import Scene, random_scene, read_back

PROPERTIES = ("colour", "background", "shape", "position")
TARGETS = {"colour": 0.95, "background": 0.95, "shape": 0.85, "position": 0.90}
BATCHINGS = ("step", "request")


def benchmark_scenes(count: int, seed: int) -> list[Scene]:
    """``count`` random scenes, each with its background named and any position (the middle too)."""
    rng = random.Random(seed)
    return [random_scene(rng) for _ in range(count)]


def shares(scenes: list[Scene], images: list[np.ndarray]) -> dict[str, float]:
    """Per property, the share of images the checker reads back as their scene asks."""
    matches = [read_back(image).matches(scene) for scene, image in zip(scenes, images, strict=True)]
    return {name: sum(match[name] for match in matches) / len(matches) for name in PROPERTIES}


def against_reference(reference: list[np.ndarray], images: list[np.ndarray]) -> dict[str, Any]:
    """Which images the checker reads differently from their reference image (same prompt and
    seed, in-process), and the largest difference of one pixel channel to it, in 0-255 steps."""
    pairs = list(zip(reference, images, strict=True))
    differing = [index for index, (expected, image) in enumerate(pairs) if read_back(expected) != read_back(image)]
    largest = max(int(np.abs(expected.astype(np.int16) - image).max()) for expected, image in pairs)
    return {"readings_differing": len(differing), "differing_images": differing, "max_pixel_difference": largest}


def generate_in_process(directory: Path, scenes: list[Scene], size: int, steps: int, guidance: float,
                        device: str = "cpu", batch: int = 8) -> list[np.ndarray]:
    """One image per scene, seeded by its index, through the pipeline's own ``__call__`` with the
    arguments the runner passes, ``batch`` scenes a call."""
    pipeline = FluxPipeline.from_pretrained(directory, dtype=torch.float32).to(device)
    pipeline.set_progress_bar_config(disable=True)
    images: list[np.ndarray] = []
    for start in range(0, len(scenes), batch):
        images.extend(pipeline_images(pipeline, scenes[start:start + batch], start, size, steps, guidance))
    return images


def pipeline_images(pipeline: FluxPipeline, scenes: list[Scene], first_seed: int, size: int, steps: int,
                    guidance: float) -> list[np.ndarray]:
    """One ``__call__`` of the pipeline for these scenes, scene i seeded ``first_seed + i``, with the
    arguments the runner passes."""
    output = pipeline(
        prompt=[scene.prompt for scene in scenes], negative_prompt=[""] * len(scenes),
        true_cfg_scale=guidance, width=size, height=size, num_inference_steps=steps,
        **max_sequence_length(pipeline),
        generator=[torch.Generator("cpu").manual_seed(first_seed + index) for index in range(len(scenes))],
        output_type="np").images
    return list((np.asarray(output) * 255).round().clip(0, 255).astype(np.uint8))


def generate_served(directory: Path, scenes: list[Scene], size: int, steps: int, guidance: float, batching: str,
                    clients: int, log_dir: Path) -> list[np.ndarray]:
    """One image per scene, seeded by its index, from a runner (``--batching batching``, on the CPU)
    and a worker batching up to ``clients`` requests, asked by ``clients`` concurrent callers;
    both processes are stopped before it returns."""
    runner = start_runner(log_dir, "--batching", batching)
    try:
        worker = start_worker(log_dir, runner.target, "--model", str(directory.resolve()),
                              "--max-batch-size", str(clients), "--max-batch-delay-ms", "5")
        try:
            with DiffusionClient(worker.target) as client:
                def one(index: int) -> np.ndarray:
                    result = client.generate(scenes[index].prompt, true_cfg_scale=guidance, width=size,
                                             height=size, steps=steps, seed=index, output_format="raw",
                                             timeout=600)
                    return result.images[0].to_numpy()

                with ThreadPoolExecutor(clients) as pool:
                    return list(pool.map(one, range(len(scenes))))
        finally:
            worker.stop()
    finally:
        runner.stop()


def missed(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each target a path misses, and each share of a served path below the in-process one."""
    reference = results["in_process"]["shares"]
    problems = []
    for path, result in results.items():
        for name in PROPERTIES:
            share = result["shares"][name]
            if share < TARGETS[name]:
                problems.append(f"{path} {name} {share:.1%} < {TARGETS[name]:.0%}")
            if share < reference[name]:
                problems.append(f"{path} {name} {share:.1%} below in-process {reference[name]:.1%}")
    return problems


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [f"{'path':<12}" + "".join(f"{name:>12}" for name in PROPERTIES) + "  readings differing  max pixel diff"]
    for path, result in results.items():
        row = f"{path:<12}" + "".join(f"{result['shares'][name]:>12.1%}" for name in PROPERTIES)
        if "readings_differing" in result:
            row += f"  {result['readings_differing']:>18}  {result['max_pixel_difference']:>14}"
        rows.append(row)
    rows.append(f"{'target':<12}" + "".join(f"{TARGETS[name]:>12.0%}" for name in PROPERTIES))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "runner_service" / "models" / "shapes")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=1.0, help="true_cfg_scale (1: no guidance)")
    parser.add_argument("--device", default="cpu", help="in-process only: the servers run on the CPU")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, and the worker's --max-batch-size")
    parser.add_argument("--batching", nargs="*", default=list(BATCHINGS), choices=BATCHINGS,
                        help="the served paths (none: in-process only)")
    parser.add_argument("--output", type=Path, default=RESULTS / "shapes.json")
    arguments = parser.parse_args(argv)
    scenes = benchmark_scenes(arguments.count, arguments.seed)
    reference = generate_in_process(arguments.model, scenes, arguments.size, arguments.steps, arguments.guidance,
                                    arguments.device)
    results: dict[str, dict[str, Any]] = {"in_process": {"shares": shares(scenes, reference)}}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-shapes-"))
    for batching in arguments.batching:
        images = generate_served(arguments.model, scenes, arguments.size, arguments.steps, arguments.guidance,
                                 batching, arguments.clients, log_dir)
        results[batching] = {"shares": shares(scenes, images), **against_reference(reference, images)}
    problems = missed(results)
    config = {name: str(value) if isinstance(value, Path) else value for name, value in vars(arguments).items()}
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps({"config": config, "targets": TARGETS, "paths": results,
                                            "missed": problems}, indent=2))
    print(table(results))
    print("\n".join(problems) or "all targets met")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
