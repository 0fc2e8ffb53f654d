"""HunyuanDiT: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.hunyuan_dit.loop import HunyuanDiTLoop
from runner_service.families.hunyuan_dit.tiny import build_hunyuan_dit
from runner_service.families.record import Family
from runner_service.families.vae_previews import SDXL_LATENTS

FAMILY = Family(
    "hunyuan-dit", "HunyuanDiTPipeline", build_hunyuan_dit, 16, loop=HunyuanDiTLoop,
    preview=SDXL_LATENTS,
    quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale` (and `guidance_rescale`); pass "
           "`use_resolution_binning=False` (else sizes not in its table map to about 1024 pixels). The "
           "pipeline sizes its rotary embedding for latents of size / 8 / patch whatever the VAE, so with the "
           "test's x1 VAE (`AutoencoderKL()`) most sizes fail or come out wrong: this VAE has four blocks "
           "(x8). Patch 2: grid 16.",
)
