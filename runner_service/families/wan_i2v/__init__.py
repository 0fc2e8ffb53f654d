"""Wan 2.1 image-to-video: the family's record; its tiny build is ``tiny.py``."""

from __future__ import annotations

from runner_service.families.record import Family, Video
from runner_service.families.wan import wan_grid
from runner_service.families.wan_i2v.tiny import build_wan_i2v

FAMILY = Family(
    "wan-i2v", "WanImageToVideoPipeline", build_wan_i2v, 16, builtin="tiny-wan-i2v",
    video=Video(16, wan_grid),
    quirks="Image-to-video (Wan 2.1): `wan`'s call plus `image` (required; resized to the video's size, the "
           "first frame) and optional `last_image`. The image also goes through a CLIP vision encoder "
           "(`image_encoder`, `image_processor`) whose embedding the transformer takes (`image_dim`); its "
           "latents and mask join the noisy latents (36 channels in). Diffusers' test config gives the "
           "image tokens no key and value projections of their own; the tiny build has them "
           "(`added_kv_proj_dim`), as Wan 2.1's image-to-video checkpoints do. Its `prompt_clean` calls `ftfy` "
           "without checking it is installed (`wan`'s checks): the runner needs `ftfy`. The tiny build's "
           "image processor is `CLIPImageProcessorPil` by name (the one `CLIPImageProcessor` falls back "
           "to without torchvision), so it saves the same everywhere.",
)
