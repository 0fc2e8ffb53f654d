"""Wan 2.1 text-to-video: the family's record; its tiny build is ``tiny.py``."""

from __future__ import annotations

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.families.record import CfgBranches, CfgLayout, Family, Video, VideoGrid
from runner_service.families.wan.tiny import build_wan


def wan_grid(pipeline: DiffusionPipeline) -> VideoGrid:
    """Wan's grid: frames 4k+1 (``vae_scale_factor_temporal``), and at most ``rope_max_seq_len``
    latent positions along each axis, since its rotary embedding is a table of that many rows that
    it slices and fails beyond (the tiny build's 32: 125 frames, 512 pixels; Wan 2.1's 1024)."""
    step = pipeline.vae_scale_factor_temporal
    config = pipeline.transformer.config
    rope = config.rope_max_seq_len
    patch_t, patch_h, patch_w = config.patch_size
    spatial = min(patch_h, patch_w) * pipeline.vae_scale_factor_spatial
    return VideoGrid(
        frame_step=step,
        max_frames=step * (rope * patch_t - 1) + 1,
        size_multiple=spatial,  # what its check_inputs wants too (16)
        max_size=rope * spatial,
    )


FAMILY = Family(
    "wan", "WanPipeline", build_wan, 16, builtin="tiny-wan", video=Video(16, wan_grid),
    quirks="Text-to-video (Wan 2.1). `callback_on_step_end`; `negative_prompt`; `guidance_scale` (and "
           "`guidance_scale_2` for Wan 2.2's second transformer); `num_frames` (default 81) is rounded "
           "to 4k+1 with only a warning (the worker refuses counts off the grid); "
           "`output_type=\"np\"` gives frames in [0, 1]. VAE x8 in space and x4 in time, patch (1, 2, 2): "
           "grid 16. The rotary table of `rope_max_seq_len` rows bounds latent frames and patches per side "
           "(the tiny build's 32: 125 frames, 512 pixels). The text encoder is a UMT5 of d_model 32 with the "
           "in-memory T5 tokenizer.",
    # pipeline_wan.py: the "cond" then the "uncond" call when guidance_scale > 1
    cfg=CfgBranches(CfgLayout.CALLS, "guidance_scale"),
)
