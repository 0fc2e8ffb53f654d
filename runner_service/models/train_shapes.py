"""Trains the built-in ``shapes`` model from nothing, on pictures it draws itself.

    python -m runner_service.models.train_shapes            # about 40 minutes on 2 CPU cores
    python -m runner_service.models.train_shapes --quick    # a minute: the same model, barely trained

The model is a ``FluxPipeline``: a word-level CLIP and T5 text encoder (tiny, trained here), a
Flux transformer without a guidance embedding (true classifier-free guidance through
``true_cfg_scale`` and the negative prompt) and a three-block ``AutoencoderKL`` (x4; 64 x 64
pictures are 8 x 8 packed tokens). It is trained in two stages on scenes drawn by
``shapes_scenes.draw``:

1. the VAE alone, to reconstruct pictures (a little KL keeps its latents smooth); its latents'
   mean and spread become ``shift_factor`` and ``scaling_factor``;
2. the transformer with both text encoders, by flow matching on the frozen VAE's latents: a
   prompt is dropped to "" one time in ten (the unconditional branch of guidance) and its
   background left out one time in seven, so "a red circle" draws any background; most batches are
   64 x 64, some 96 or 128, so every size on the grid up to 128 draws.

Everything is seeded: the same torch build and thread count give the same bytes. The result is
written in diffusers format (float16 safetensors) to ``runner_service/models/shapes``, which the
runner serves as the built-in ``shapes`` model.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from runner_service.families.text_models import word_clip_tokenizer, word_t5_tokenizer
from runner_service.models.shapes_scenes import VOCABULARY, Scene, draw, random_scene

logger = logging.getLogger(__name__)

OUTPUT = Path(__file__).with_name("shapes")
MAX_TOKENS = 12  # the longest prompt is 10 words; CLIP adds a start and an end token
TEXT_WIDTH = 64


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vae_steps: int = 1500
    vae_batch: int = 16
    vae_lr: float = 1e-3
    steps: int = 6000
    batch: int = 32
    lr: float = 5e-4
    ema: float = 0.999
    condition_drop: float = 0.1  # prompts trained as "": the unconditional branch of guidance
    background_drop: float = 1 / 7  # prompts without their background: any colour but the shape's
    large_every: int = 5  # one batch in this many is 96 or 128 pixels (a quarter as many images)


QUICK = Recipe(vae_steps=40, steps=40)


def build_untrained(seed: int) -> FluxPipeline:
    """The pipeline with seeded random weights: each component right after seeding torch."""
    clip_tokenizer = word_clip_tokenizer(VOCABULARY, MAX_TOKENS)
    t5_tokenizer = word_t5_tokenizer(VOCABULARY, MAX_TOKENS)

    def seeded(offset: int) -> None:
        torch.manual_seed(seed + offset)

    seeded(1)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MAX_TOKENS, projection_dim=TEXT_WIDTH,
        bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id))
    seeded(2)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=TEXT_WIDTH, d_ff=2 * TEXT_WIDTH, d_kv=16, num_heads=4, num_layers=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id))
    seeded(3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(16, 32, 64),
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        latent_channels=4, layers_per_block=1, norm_num_groups=8, sample_size=64,
        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False)
    seeded(4)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                        tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer,
                        transformer=transformer)


def pictures(scenes: list[Scene], size: int, rng: random.Random, device: torch.device) -> torch.Tensor:
    """The scenes drawn at ``size``, as a batch in [-1, 1]."""
    images = np.stack([draw(scene, size, size, rng) for scene in scenes])
    return torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1


def train_vae(vae: AutoencoderKL, recipe: Recipe, rng: random.Random) -> None:
    optimizer = torch.optim.Adam(vae.parameters(), lr=recipe.vae_lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _cosine(step, recipe.vae_steps))
    vae.train()
    for step in range(recipe.vae_steps):
        scenes = [random_scene(rng) for _ in range(recipe.vae_batch)]
        images = pictures(scenes, 64, rng, vae.device)
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=None)).sample
        loss = F.mse_loss(reconstruction, images) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        _log("vae", step, recipe.vae_steps, loss)
    vae.eval()
    with torch.no_grad():
        scenes = [random_scene(rng) for _ in range(256)]
        latents = vae.encode(pictures(scenes, 64, rng, vae.device)).latent_dist.mode()
    shift, spread = float(latents.mean()), float(latents.std())
    vae.register_to_config(  # type: ignore[no-untyped-call]  # diffusers leaves it untyped
        shift_factor=round(shift, 4), scaling_factor=round(1 / spread, 4))
    logger.info("vae latents: mean %.4f, std %.4f", shift, spread)


def train_denoiser(pipeline: FluxPipeline, recipe: Recipe, rng: random.Random) -> None:
    trained = [pipeline.transformer, pipeline.text_encoder, pipeline.text_encoder_2]
    parameters = [p for module in trained for p in module.parameters()]
    averages = [copy.deepcopy(module).requires_grad_(False) for module in trained]
    optimizer = torch.optim.AdamW(parameters, lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _cosine(step, recipe.steps))
    vae = pipeline.vae.requires_grad_(False)
    for module in trained:
        module.train()
    for step in range(recipe.steps):
        size, count = 64, recipe.batch
        if step % recipe.large_every == recipe.large_every - 1:
            size, count = rng.choice((96, 128)), max(1, recipe.batch // 4)
        scenes = [random_scene(rng) for _ in range(count)]
        prompts = []
        for scene in scenes:
            roll = rng.random()
            if roll < recipe.condition_drop:
                prompts.append("")
            elif roll < recipe.condition_drop + recipe.background_drop:
                prompts.append(Scene(scene.colour, scene.shape, "", scene.position).prompt)
            else:
                prompts.append(scene.prompt)
        images = pictures(scenes, size, rng, vae.device)
        with torch.no_grad():
            clean = (vae.encode(images).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
        loss = flow_matching_loss(pipeline, clean, prompts)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        decay = min(recipe.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for average, module in zip(averages, trained, strict=True):
                for kept, live in zip(average.parameters(), module.parameters(), strict=True):
                    kept.lerp_(live, 1 - decay)
        _log("denoiser", step, recipe.steps, loss)
    for average, module in zip(averages, trained, strict=True):
        module.load_state_dict(average.state_dict())
        module.eval()


def flow_matching_loss(pipeline: FluxPipeline, clean: torch.Tensor, prompts: list[str],
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The transformer's flow-matching loss on clean latents: noise at a logit-normal sigma, the
    velocity (noise - clean) as target. Draws from ``generator``, or torch's global one."""
    noise = torch.randn_like(clean, generator=generator)  # in clean's memory layout, as the committed model drew it
    sigma = torch.sigmoid(torch.randn(len(clean), generator=generator, device=clean.device))
    noisy = (1 - sigma[:, None, None, None]) * clean + sigma[:, None, None, None] * noise
    return F.mse_loss(predict(pipeline, noisy, sigma, prompts), pack(noise - clean))


def pack(latents: torch.Tensor) -> torch.Tensor:
    batch, channels, height, width = latents.shape
    packed: torch.Tensor = FluxPipeline._pack_latents(  # type: ignore[no-untyped-call]  # diffusers: untyped
        latents, batch, channels, height, width)
    return packed


def predict(pipeline: FluxPipeline, noisy: torch.Tensor, sigma: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The transformer's velocity for noisy latents, as ``FluxPipeline.__call__`` asks for it."""
    embeds, pooled, text_ids = pipeline.encode_prompt(prompts, prompt_2=None, device=noisy.device,
                                                      max_sequence_length=MAX_TOKENS)
    batch, _, height, width = noisy.shape
    image_ids = FluxPipeline._prepare_latent_image_ids(  # type: ignore[no-untyped-call]  # diffusers: untyped
        batch, height // 2, width // 2, noisy.device, noisy.dtype)
    predicted: torch.Tensor = pipeline.transformer(
        hidden_states=pack(noisy), timestep=sigma, guidance=None, pooled_projections=pooled,
        encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
    return predicted


def _cosine(step: int, total: int, warmup: int = 100) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


_last_log = [0.0]


def _log(stage: str, step: int, total: int, loss: torch.Tensor) -> None:
    loss = loss.detach()
    now = time.monotonic()
    if step + 1 == total or now - _last_log[0] > 30:
        _last_log[0] = now
        logger.info("%s step %d/%d loss %.4f", stage, step + 1, total, loss.item())


def train(recipe: Recipe, device: torch.device) -> FluxPipeline:
    rng = random.Random(recipe.seed)
    pipeline = build_untrained(recipe.seed).to(device)
    torch.manual_seed(recipe.seed)
    started = time.monotonic()
    train_vae(pipeline.vae, recipe, rng)
    logger.info("vae trained in %.0f s", time.monotonic() - started)
    train_denoiser(pipeline, recipe, rng)
    logger.info("trained in %.0f s", time.monotonic() - started)
    return pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where the model is written")
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage: checks the script runs")
    parser.add_argument("--steps", type=int, help="denoiser steps (default: the recipe's)")
    parser.add_argument("--vae-steps", type=int, help="VAE steps (default: the recipe's)")
    parser.add_argument("--device", default="cpu", help="where to train (a GPU trains other bytes, faster)")
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    recipe = QUICK if arguments.quick else Recipe()
    if arguments.steps is not None or arguments.vae_steps is not None:
        recipe = Recipe(**{**recipe.__dict__, "steps": arguments.steps or recipe.steps,
                           "vae_steps": arguments.vae_steps or recipe.vae_steps})
    pipeline = train(recipe, torch.device(arguments.device))
    pipeline.to("cpu", torch.float16).save_pretrained(arguments.output, safe_serialization=True)
    logger.info("written to %s", arguments.output)


if __name__ == "__main__":
    main()
