"""PixArt-alpha: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.pixart_alpha.loop import PixArtAlphaLoop
from runner_service.families.pixart_alpha.tiny import build_pixart_alpha
from runner_service.families.pixart_sigma import QUIRKS
from runner_service.families.record import Family
from runner_service.families.vae_previews import SD1_LATENTS

FAMILY = Family(
    "pixart-alpha", "PixArtAlphaPipeline", build_pixart_alpha, 8, loop=PixArtAlphaLoop,
    preview=SD1_LATENTS,
    quirks=QUIRKS,
)
