"""InstructPix2Pix's tiny random build: the ``tiny`` SD 1.x with an 8-channel UNet."""

from __future__ import annotations

from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_instruct_pix2pix import (
    StableDiffusionInstructPix2PixPipeline,
)

from runner_service.families.sd.tiny import build_sd
from runner_service.families.seeded import seeded


def build_instruct_pix2pix() -> StableDiffusionInstructPix2PixPipeline:
    """InstructPix2Pix, an edit model: the ``tiny`` SD 1.x with a UNet that takes the image's
    latents beside the noisy ones (8 channels in), as in diffusers' own test."""
    base = build_sd("tiny")
    unet = seeded(lambda: UNet2DConditionModel.from_config(base.unet.config, in_channels=8))
    return StableDiffusionInstructPix2PixPipeline(**{**base.components, "unet": unet}, requires_safety_checker=False)
