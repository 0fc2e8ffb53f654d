"""Stable Diffusion 3: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.record import CfgBranches, CfgLayout, Family
from runner_service.families.sd3.loop import StableDiffusion3Loop
from runner_service.families.sd3.tiny import build_sd3
from runner_service.families.vae_previews import SD3_LATENTS

FAMILY = Family(
    "sd3", "StableDiffusion3Pipeline", build_sd3, 1, loop=StableDiffusion3Loop, builtin="tiny-sd3",
    preview=SD3_LATENTS,
    quirks="`callback_on_step_end`; `negative_prompt` (`_2`, `_3`); `guidance_scale`; `max_sequence_length` "
           "for T5. VAE x1 (one block), patch 1: grid 1, and a 1x1 image works.",
    # pipeline_stable_diffusion_3.py: torch.cat([latents] * 2) when guidance_scale > 1
    cfg=CfgBranches(CfgLayout.ROWS, "guidance_scale"),
)
