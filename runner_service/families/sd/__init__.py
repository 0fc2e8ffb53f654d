"""Stable Diffusion 1.x/2.x: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from functools import partial

from runner_service.families.record import CfgBranches, CfgLayout, Family
from runner_service.families.sd.loop import StableDiffusionLoop
from runner_service.families.sd.tiny import build_sd
from runner_service.families.vae_previews import SD1_LATENTS

FAMILY = Family(
    "sd", "StableDiffusionPipeline", partial(build_sd, "tiny"), 24, loop=StableDiffusionLoop,
    preview=SD1_LATENTS,
    quirks="The built-in `tiny` model. `callback_on_step_end`; `negative_prompt`; `guidance_scale`. VAE x8, "
           "grid 8. Smallest 24: at 16 a UNet GroupNorm gets one value per group when the batch is a single "
           "image (no CFG; with CFG 16 works).",
    # pipeline_stable_diffusion.py: torch.cat([latents] * 2) when guidance_scale > 1 (the UNet's sample and, SDXL,
    # added_cond_kwargs split by rows alike)
    cfg=CfgBranches(CfgLayout.ROWS, "guidance_scale"),
)
