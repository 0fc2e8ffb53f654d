"""Stable Diffusion XL: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.record import CfgBranches, CfgLayout, Family
from runner_service.families.sdxl.loop import StableDiffusionXLLoop
from runner_service.families.sdxl.tiny import build_sdxl
from runner_service.families.vae_previews import SDXL_LATENTS

FAMILY = Family(
    "sdxl", "StableDiffusionXLPipeline", build_sdxl, 8, loop=StableDiffusionXLLoop,
    builtin="tiny-sdxl", preview=SDXL_LATENTS,
    quirks="`callback_on_step_end`; `negative_prompt` (and `negative_prompt_2`); `guidance_scale`. VAE x2 "
           "(two blocks); `check_inputs` wants a multiple of 8. Built with `add_watermarker=False` (no "
           "invisible-watermark package).",
    # pipeline_stable_diffusion_xl.py: torch.cat([latents] * 2) when guidance_scale > 1 (the UNet's sample and, SDXL,
    # added_cond_kwargs split by rows alike)
    cfg=CfgBranches(CfgLayout.ROWS, "guidance_scale"),
)
