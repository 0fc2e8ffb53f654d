"""Flux: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.flux.loop import FluxLoop
from runner_service.families.flux.tiny import build_flux
from runner_service.families.record import CfgBranches, CfgLayout, Family
from runner_service.families.vae_previews import FLUX_LATENTS

FAMILY = Family(
    "flux", "FluxPipeline", build_flux, 2, loop=FluxLoop, builtin="tiny-flux", preview=FLUX_LATENTS,
    quirks="Built with `guidance_embeds=True`. `callback_on_step_end`; `negative_prompt` only counts with "
           "`true_cfg_scale > 1` (real CFG, a second pass); `guidance_scale` is the distilled guidance fed to "
           "the transformer's guidance embedding, not CFG. VAE x1, latents packed 2x2: grid 2.",
    # pipeline_flux.py: transformer(...) then, for true CFG (true_cfg_scale > 1 and a negative prompt), again
    cfg=CfgBranches(CfgLayout.CALLS, "true_cfg_scale"),
)
