"""What a latent preview (``partial_images``) costs beside the denoising step it follows.

``python -m benchmarks.bench_previews [--model tiny] [--size 128] [--steps 20] [--device cpu]``
loads the model in this process and calls its pipeline (as a request-level batch does) for one
SIZE x SIZE image of STEPS steps, twice, and prints as JSON: ``step_ms``, the median time between
two steps' ends of the first call, which takes no previews; ``preview_ms``, the median time of
``take_previews`` in the second, which takes one preview of the latents after every step (the
linear map, the copy to the host), exactly as the runner calls it; and ``preview_share``, their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from runner_service.families import latent_preview
from runner_service.loaded_model import check_source, load_model
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache
from runner_service.pipeline_adapter import ImageRows
from runner_service.platforms import select_platform
from runner_service.previews import PreviewTarget, take_previews
from serving_common.generation_params import GenerationParams


def measure(model_name: str, size: int, steps: int, device: str) -> dict[str, float | int | str]:
    model = load_model(check_source(model_name, None, ModelRoots(), HubCache()), None, select_platform(device))
    preview, target = latent_preview(model.pipeline), PreviewTarget("bench", 0, 1)
    ends: list[float] = []
    spent: list[float] = []
    shapes: list[str] = []

    def on_latents(done: int, total: int, latents: torch.Tensor) -> None:
        began = time.perf_counter()
        taken = take_previews(preview, [target], latents, 1, 2)  # one preview of one, due after step 1 of 2
        spent.append(time.perf_counter() - began)
        if not taken:
            raise SystemExit(f"{model_name}'s family has no preview map for its {latents.shape[1]}-channel latents")
        shapes.append("x".join(map(str, latents.shape)))

    def run(with_previews: bool) -> None:
        with torch.inference_mode():
            model.adapter.generate(ImageRows.of("a red fox", "", [1]),
                                   GenerationParams(width=size, height=size, num_inference_steps=steps,
                                                    guidance_scale=model.capabilities.default_guidance),
                                   lambda done, total: ends.append(time.perf_counter()),
                                   on_latents=on_latents if with_previews else None)

    run(False)  # warm-up
    ends.clear()
    run(False)
    step_ms = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False)) * 1000
    run(True)
    preview_ms = statistics.median(spent) * 1000
    return {"model": model_name, "size": size, "steps": steps, "device": device, "latents": shapes[0],
            "step_ms": round(step_ms, 3),
            "preview_ms": round(preview_ms, 4), "preview_share": round(preview_ms / step_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description="What a latent preview costs beside a denoising step.")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.size, args.steps, args.device)))


if __name__ == "__main__":
    main()
