"""PixArt-Sigma: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.pixart_sigma.loop import PixArtSigmaLoop
from runner_service.families.pixart_sigma.tiny import build_pixart_sigma
from runner_service.families.record import Family
from runner_service.families.vae_previews import SDXL_LATENTS

# PixArt-alpha and PixArt-Sigma share their call and the components of their tiny builds.
QUIRKS = (
    "Legacy `callback`/`callback_steps` only: a `callback_on_step_end` is swallowed by `**kwargs` and "
    "never called, without an error; `negative_prompt` (default `\"\"`); `guidance_scale`. Pass "
    "`use_resolution_binning=False`: binning picks its aspect-ratio table from "
    "`transformer.config.sample_size` (128, 64 or 32 only) and raises for these tiny transformers. "
    "`clean_caption=True` by default wants bs4 and ftfy (without them it warns and goes on). VAE x1 "
    "(diffusers' default `AutoencoderKL()`), patch 2, but `check_inputs` wants a multiple of 8."
)

FAMILY = Family(
    "pixart-sigma", "PixArtSigmaPipeline", build_pixart_sigma, 8, loop=PixArtSigmaLoop,
    preview=SDXL_LATENTS,
    quirks=QUIRKS,
)
