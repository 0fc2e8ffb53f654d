"""FLUX.1-dev's transformer at its full size, with random weights, denoising one 1024 x 1024 image in
28 steps: plain, with the fastest attention backend offered, plus regional compile, plus the step
cache. The GPU real-size case of issue 24 (SGLang's anchor: 3.82 s on one H200 with its native
FlashAttention 3; 5.58 s on its diffusers backend).

    python -m benchmarks.flux_full                      # on the CUDA device, bf16, full size
    python -m benchmarks.flux_full --device cpu --dtype float32 --layers 1 1 --heads 2 --size 128 \\
        --steps 2 --text-tokens 16 --stages plain cache    # a toy smoke run

The transformer is built from FLUX.1-dev's configuration (``FLUX_DEV``) on the device in the chosen
dtype and initialised at random: the same shapes and FLOPs as the real model, nothing downloaded.
The timed loop is what a pipeline's denoising costs: one transformer call per step (4096 image
tokens at 1024 x 1024, 512 text tokens, distilled guidance 3.5) and the Euler step; no text
encoders, no VAE. Each stage is a fresh transformer given to the runner's own
``runner_service.acceleration.apply.accelerate`` inside a ``FluxPipeline`` with no other
components, each adding to the last:

- ``plain``: diffusers as loaded;
- ``attention``: every backend the runner offers on this device is timed for a few steps, and the
  fastest is kept for the later stages;
- ``compile``: plus regional ``torch.compile`` of the repeated blocks;
- ``cache``: plus ``first_block_cache`` (``--threshold``). With random weights its skip share says
  little about a trained model's; it is reported beside the time.

A stage's first loop (where compile compiles) is timed apart; the figure is the fastest of
``--repeats`` loops after it. Writes ``benchmarks/results/flux_full.json`` and prints a table; at
FLUX.1-dev's full size on CUDA it exits 1 when no stage reaches ``SGLANG_NATIVE_S``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from benchmarks.bench import RESULTS
from runner_service.acceleration.apply import accelerate, offer
from runner_service.acceleration.row_cache import RowCache
from runner_service.platforms import Platform, select_platform
from serving_common.input_rules import FIRST_BLOCK_CACHE, AccelerationPlan

FLUX_DEV: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
STAGES = ("plain", "attention", "compile", "cache")
SGLANG_NATIVE_S = 3.82
GUIDANCE = 3.5
ATTENTION_TRIAL_STEPS = 3


def flux_config(double: int, single: int, heads: int) -> dict[str, Any]:
    """FLUX.1-dev's transformer configuration with these block and head counts."""
    return {**FLUX_DEV, "num_layers": double, "num_single_layers": single, "num_attention_heads": heads}


def build_pipeline(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> FluxPipeline:
    """A ``FluxPipeline`` holding only a transformer of ``config`` with random weights, built on
    ``device`` in ``dtype`` (the runner accelerates a pipeline; the other components are not timed)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            transformer = FluxTransformer2DModel(**config)
    finally:
        torch.set_default_dtype(default)
    transformer.eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,  # type: ignore[arg-type]
                        text_encoder=None, tokenizer=None, text_encoder_2=None,  # type: ignore[arg-type]
                        tokenizer_2=None, transformer=transformer)


@dataclass(frozen=True)
class Inputs:
    """One image's denoising inputs: packed latents, text states and token positions."""

    latents: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    image_ids: torch.Tensor
    text_ids: torch.Tensor
    guidance: torch.Tensor

    @classmethod
    def random(cls, config: dict[str, Any], size: int, text_tokens: int, device: torch.device, dtype: torch.dtype,
               seed: int) -> Inputs:
        generator = torch.Generator("cpu").manual_seed(seed)
        side = size // 16  # the VAE's 8x, then Flux's 2x2 packing
        def noise(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, dtype)

        return cls(
            latents=noise(1, side * side, config["in_channels"]),
            text=noise(1, text_tokens, config["joint_attention_dim"]),
            pooled=noise(1, config["pooled_projection_dim"]),
            image_ids=FluxPipeline._prepare_latent_image_ids(1, side, side, device, dtype),
            text_ids=torch.zeros(text_tokens, 3, device=device, dtype=dtype),
            guidance=torch.full((1,), GUIDANCE, device=device, dtype=torch.float32))


def denoise(transformer: torch.nn.Module, inputs: Inputs, steps: int) -> torch.Tensor:
    """The denoising loop: a transformer call per step at its sigma, then the Euler step."""
    sigmas = torch.linspace(1.0, 1.0 / steps, steps).tolist() + [0.0]
    latents = inputs.latents
    for sigma, following in zip(sigmas, sigmas[1:], strict=False):
        timestep = torch.full((1,), sigma, device=latents.device, dtype=latents.dtype)
        velocity = transformer(hidden_states=latents, timestep=timestep, guidance=inputs.guidance,
                               pooled_projections=inputs.pooled, encoder_hidden_states=inputs.text,
                               txt_ids=inputs.text_ids, img_ids=inputs.image_ids, return_dict=False)[0]
        latents = latents + (following - sigma) * velocity
    return latents


@contextlib.contextmanager
def caching(cache: RowCache | None, steps: int) -> Iterator[None]:
    """One image's call with the model's threshold, as the runner's request-level path does."""
    if cache is None:
        yield
        return
    with cache.pipeline_call([cache.threshold], steps):
        yield


def timed(pipeline: FluxPipeline, cache: RowCache | None, inputs: Inputs, steps: int, platform: Platform) -> float:
    """Seconds of one denoising loop, the device synchronised on both sides."""
    platform.synchronize()
    start = time.perf_counter()
    with torch.inference_mode(), caching(cache, steps):
        denoise(pipeline.transformer, inputs, steps)
    platform.synchronize()
    return time.perf_counter() - start


@dataclass
class Stage:
    name: str
    plan: AccelerationPlan
    first_s: float
    seconds: float
    skipped_share: float | None
    attention_trials_s: dict[str, float] = dataclasses.field(default_factory=dict)


def measure(config: dict[str, Any], plan: AccelerationPlan, inputs: Inputs, steps: int, repeats: int,
            platform: Platform, dtype: torch.dtype, name: str) -> Stage:
    """A fresh transformer accelerated by ``plan``: its first loop, then the fastest of ``repeats``."""
    pipeline = build_pipeline(config, platform.device, dtype, seed=0)
    cache = accelerate(pipeline, plan, platform)
    first = timed(pipeline, cache, inputs, steps, platform)
    before = (0, 0) if cache is None else (cache.rows_run, cache.rows_skipped)
    seconds = min(timed(pipeline, cache, inputs, steps, platform) for _ in range(repeats))
    skipped = None if cache is None else (cache.rows_skipped - before[1]) / max(cache.rows_run - before[0], 1)
    del pipeline, cache
    platform.empty_cache()
    return Stage(name, plan, first, seconds, skipped)


def fastest_backend(config: dict[str, Any], inputs: Inputs, platform: Platform, dtype: torch.dtype,
                    steps: int) -> tuple[str, dict[str, float]]:
    """The attention backend the runner offers here whose loop of ``steps`` steps is fastest (each
    after a step that warms it up), and every backend's time: one transformer, its backend set by
    ``accelerate`` for each in turn."""
    pipeline = build_pipeline(config, platform.device, dtype, seed=0)
    backends = list(offer(pipeline, platform).attention_backends)
    trials: dict[str, float] = {}
    for backend in backends:
        try:
            accelerate(pipeline, AccelerationPlan(attention_backend=backend), platform)
            timed(pipeline, None, inputs, 1, platform)
            trials[backend] = timed(pipeline, None, inputs, steps, platform)
        except Exception as error:  # a backend offered but failing on these shapes is reported, not fatal
            print(f"attention backend {backend}: {type(error).__name__}: {error}", file=sys.stderr)
    del pipeline
    platform.empty_cache()
    if not trials:
        raise RuntimeError(f"no attention backend ran (offered: {backends})")
    return min(trials, key=lambda backend: trials[backend]), trials


def run(stages: list[str], config: dict[str, Any], inputs: Inputs, steps: int, repeats: int, threshold: float,
        platform: Platform, dtype: torch.dtype) -> list[Stage]:
    """The stages in order, each adding its method to the previous stage's plan."""
    plan = AccelerationPlan()
    results = []
    for name in stages:
        trials: dict[str, float] = {}
        if name == "attention":
            backend, trials = fastest_backend(config, inputs, platform, dtype, ATTENTION_TRIAL_STEPS)
            plan = dataclasses.replace(plan, attention_backend=backend)
        elif name == "compile":
            plan = dataclasses.replace(plan, compile=True)
        elif name == "cache":
            plan = dataclasses.replace(plan, cache=FIRST_BLOCK_CACHE, cache_threshold=threshold)
        stage = measure(config, plan, inputs, steps, repeats, platform, dtype, name)
        stage.attention_trials_s = trials
        results.append(stage)
        print(f"{name}: {stage.seconds:.3f} s (first loop {stage.first_s:.3f} s)", flush=True)
    return results


def table(results: list[Stage], device_name: str) -> str:
    rows = [f"| stage ({device_name}) | plan | seconds per image | first loop s | speed-up | rows skipped |",
            "|---|---|---|---|---|---|"]
    for stage in results:
        plan = ", ".join(f"{key}={value}" for key, value in dataclasses.asdict(stage.plan).items()
                         if value != getattr(AccelerationPlan(), key)) or "plain"
        skipped = "" if stage.skipped_share is None else f"{stage.skipped_share:.0%}"
        rows.append(f"| {stage.name} | {plan} | {stage.seconds:.3f} | {stage.first_s:.2f} "
                    f"| {results[0].seconds / stage.seconds:.2f}x | {skipped} |")
    return "\n".join(rows)


def add_configuration_arguments(parser: argparse.ArgumentParser) -> None:
    """The transformer's configuration and the run's size, FLUX.1-dev's by default (flux_group's too)."""
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--layers", type=int, nargs=2, default=[19, 38], metavar=("DOUBLE", "SINGLE"),
                        help="double-stream and single-stream blocks")
    parser.add_argument("--heads", type=int, default=24, help="attention heads of 128 channels")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=28)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    add_configuration_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="timed loops per stage after the first")
    parser.add_argument("--threshold", type=float, default=0.1, help="the cache's threshold")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--output", type=Path, default=RESULTS / "flux_full.json")
    arguments = parser.parse_args(argv)
    platform = select_platform(arguments.device)
    dtype = getattr(torch, arguments.dtype)
    config = flux_config(arguments.layers[0], arguments.layers[1], arguments.heads)
    inputs = Inputs.random(config, arguments.size, arguments.text_tokens, platform.device, dtype, seed=0)
    results = run([stage for stage in STAGES if stage in arguments.stages], config, inputs, arguments.steps,
                  arguments.repeats, arguments.threshold, platform, dtype)
    device_name = platform.device_name()
    full_size = config == FLUX_DEV and (arguments.size, arguments.text_tokens, arguments.steps) == (1024, 512, 28)
    best = min(stage.seconds for stage in results)
    missed = full_size and platform.name == "cuda" and best > SGLANG_NATIVE_S
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps({
        "config": {**{name: str(value) if isinstance(value, Path) else value
                      for name, value in vars(arguments).items()},
                   "transformer": config, "device_name": device_name, "torch": torch.__version__},
        "stages": [dataclasses.asdict(stage) for stage in results],
        "best_s": best, "sglang_native_s": SGLANG_NATIVE_S, "missed": missed}, indent=2))
    print(table(results, device_name))
    if full_size and platform.name == "cuda":
        print(f"fastest {best:.2f} s against SGLang's native {SGLANG_NATIVE_S} s: {'missed' if missed else 'met'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
