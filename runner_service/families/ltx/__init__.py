"""LTX-Video text-to-video: the family's record; its tiny build is ``tiny.py``."""

from __future__ import annotations

import math

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.families.ltx.tiny import build_ltx
from runner_service.families.record import Family, Video, VideoGrid

# LTX-Video's check_inputs wants multiples of 32 whatever its VAE and patch sizes.
_LTX_CHECKED_MULTIPLE = 32


def ltx_grid(pipeline: DiffusionPipeline) -> VideoGrid:
    """LTX-Video's grid: frames ``vae_temporal_compression_ratio`` k + 1 (8k+1 for the real VAE, 4k+1
    for the tiny build's), sizes multiples of the VAE ratio times the patch and of 32; its rotary
    position embedding is computed for the latents' size, so no limit of the model's own."""
    spatial = pipeline.vae_spatial_compression_ratio * pipeline.transformer_spatial_patch_size
    return VideoGrid(
        frame_step=pipeline.vae_temporal_compression_ratio * pipeline.transformer_temporal_patch_size,
        max_frames=0,
        size_multiple=math.lcm(spatial, _LTX_CHECKED_MULTIPLE),
        max_size=0,
    )


FAMILY = Family(
    "ltx", "LTXPipeline", build_ltx, 32, video=Video(25, ltx_grid),
    quirks="Text-to-video (LTX-Video 0.9). `callback_on_step_end`; `negative_prompt`; `guidance_scale` (default "
           "3); `num_frames` (default 161) rounds down to 8k+1 with the real VAE (4k+1 with the tiny build's, "
           "whose VAE compresses time 4x); `frame_rate` (default 25) conditions the transformer's rotary "
           "embedding: the runner leaves it at 25, the fps its checkpoints are trained for. `check_inputs` "
           "wants multiples of 32 whatever the VAE (the tiny build's is x4, patch 1). Diffusers' test VAE has "
           "a decoder of the real model's width (about 900 MB saved, and videos twice the size asked for): "
           "this decoder mirrors the 8-wide encoder.",
)
