"""Prompt adherence of the built-in ``shapes`` model: for random prompts, the share of images whose
object colour, background colour, shape and position the checker (``shapes_scenes.read_back``,
pixel statistics, no model) reads back as asked.

    python -m benchmarks.bench_shapes --count 200

In-process through ``FluxPipeline.from_pretrained`` and ``__call__``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from runner_service.models.shapes_scenes import Scene, random_scene, read_back

PROPERTIES = ("colour", "background", "shape", "position")
TARGETS = {"colour": 0.95, "background": 0.95, "shape": 0.85, "position": 0.90}


def benchmark_scenes(count: int, seed: int) -> list[Scene]:
    """``count`` random scenes, each with its background named and any position (the middle too)."""
    rng = random.Random(seed)
    return [random_scene(rng) for _ in range(count)]


def shares(scenes: list[Scene], images: list[np.ndarray]) -> dict[str, float]:
    """Per property, the share of images the checker reads back as their scene asks."""
    matches = [read_back(image).matches(scene) for scene, image in zip(scenes, images, strict=True)]
    return {name: sum(match[name] for match in matches) / len(matches) for name in PROPERTIES}


def generate_in_process(directory: Path, scenes: list[Scene], size: int, steps: int, guidance: float,
                        device: str = "cpu", batch: int = 8) -> list[np.ndarray]:
    """One image per scene, seeded by its index, through the pipeline's own ``__call__``."""
    pipeline = FluxPipeline.from_pretrained(directory, dtype=torch.float32).to(device)
    pipeline.set_progress_bar_config(disable=True)
    images: list[np.ndarray] = []
    for start in range(0, len(scenes), batch):
        chunk = scenes[start:start + batch]
        output = pipeline(
            prompt=[scene.prompt for scene in chunk], negative_prompt=[""] * len(chunk),
            true_cfg_scale=guidance, width=size, height=size, num_inference_steps=steps,
            max_sequence_length=pipeline.tokenizer_2.model_max_length,
            generator=[torch.Generator("cpu").manual_seed(start + index) for index in range(len(chunk))],
            output_type="np").images
        images.extend((np.asarray(output) * 255).round().clip(0, 255).astype(np.uint8))
    return images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("runner_service/models/shapes"))
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=1.0, help="true_cfg_scale (1: no guidance)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=1)
    arguments = parser.parse_args(argv)
    scenes = benchmark_scenes(arguments.count, arguments.seed)
    images = generate_in_process(arguments.model, scenes, arguments.size, arguments.steps, arguments.guidance,
                                 arguments.device)
    result = shares(scenes, images)
    print(json.dumps({"in_process": result, "size": arguments.size, "steps": arguments.steps,
                      "guidance": arguments.guidance, "count": arguments.count}))
    return 0 if all(result[name] >= TARGETS[name] for name in PROPERTIES) else 1


if __name__ == "__main__":
    sys.exit(main())
