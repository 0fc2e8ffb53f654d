"""InstructPix2Pix, an edit model: the family's record; its tiny build is ``tiny.py``, its loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.instruct_pix2pix.loop import InstructPix2PixLoop
from runner_service.families.instruct_pix2pix.tiny import build_instruct_pix2pix
from runner_service.families.record import Family
from runner_service.families.vae_previews import SD1_LATENTS

FAMILY = Family(
    "instruct-pix2pix", "StableDiffusionInstructPix2PixPipeline", build_instruct_pix2pix, 24,
    edit=True, loop=InstructPix2PixLoop, preview=SD1_LATENTS,
    quirks="An edit model: `image` and the instruction as `prompt`; `image_guidance_scale` beside "
           "`guidance_scale`. The `tiny` SD 1.x with a UNet that takes the image's latents beside the noisy "
           "ones (8 channels in), as in diffusers' own test; its grid and smallest size are `tiny`'s.",
)
