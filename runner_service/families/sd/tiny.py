"""Stable Diffusion 1.x pipelines with seeded random weights: the built-in models ``tiny`` (the
family's tiny build) and ``small``.

No model hub is reachable from where this runs, so these built-in models are constructed from
configs, saved in diffusers format and then loaded back through the ordinary
``DiffusionPipeline.from_pretrained`` path like any other model directory (``models.catalog``). The
same name gives the same bytes on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

# diffusers classes from their modules: the package's lazy top-level names resolve to placeholder
# classes for type checkers.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from transformers import CLIPTextConfig, CLIPTextModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import clip_tokenizer


@dataclass(frozen=True)
class BuiltinSpec:
    """Sizes of one built-in model; everything else is shared by the family."""

    unet_channels: tuple[int, ...]
    vae_channels: tuple[int, ...]
    text_hidden: int
    text_layers: int
    attention_head_dim: int


# The Stable Diffusion 1.x sizes of the built-in models (``models.catalog.BUILTIN_MODELS`` has them all).
SD_SPECS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(
        unet_channels=(32, 64), vae_channels=(32, 32, 32, 32), text_hidden=32, text_layers=2, attention_head_dim=8
    ),
    "small": BuiltinSpec(
        unet_channels=(64, 128, 256),
        vae_channels=(32, 64, 64, 64),
        text_hidden=256,
        text_layers=4,
        attention_head_dim=32,
    ),
}


def build_sd(name: str) -> StableDiffusionPipeline:
    """Builds the named Stable Diffusion built-in (a key of ``SD_SPECS``) in memory, with seeded random weights."""
    spec = SD_SPECS[name]
    tokenizer = clip_tokenizer()
    down = ("CrossAttnDownBlock2D",) * (len(spec.unet_channels) - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (len(spec.unet_channels) - 1)
    unet = seeded(lambda: UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=spec.unet_channels,
        down_block_types=down,
        up_block_types=up,
        cross_attention_dim=spec.text_hidden,
        attention_head_dim=spec.attention_head_dim,
        norm_num_groups=32,
    ))
    vae = seeded(lambda: AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=spec.vae_channels,
        down_block_types=("DownEncoderBlock2D",) * len(spec.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(spec.vae_channels),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=32,
    ))
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = seeded(lambda: CLIPTextModel(text_config))
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    # diffusers annotates the safety checker and feature extractor without None, which its own docs
    # use to build a pipeline without them.
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,  # type: ignore[arg-type]
        feature_extractor=None,
        requires_safety_checker=False,
    )
