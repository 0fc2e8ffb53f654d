"""Lumina 2: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.lumina2.loop import Lumina2Loop
from runner_service.families.lumina2.tiny import build_lumina2
from runner_service.families.record import Family
from runner_service.families.vae_previews import FLUX_LATENTS

FAMILY = Family(
    "lumina2", "Lumina2Pipeline", build_lumina2, 16, loop=Lumina2Loop, preview=FLUX_LATENTS,
    quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale` (with `cfg_trunc_ratio`, "
           "`cfg_normalization`); `system_prompt`. The pipeline hard-codes `vae_scale_factor = 8` (with patch "
           "2: grid 16), so the test's one-block VAE (x1) would give an image 8 times too small: this VAE has "
           "four blocks (x8).",
)
