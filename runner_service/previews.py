"""Latent previews: a cheap picture of an image's latents part way through its denoising, for
``ExecuteItem.partial_images`` (the OpenAI Images API's ``partial_images``).

A preview is not a VAE decode: it is a fixed linear map from the latent channels to RGB at the
latent resolution (A1111's and ComfyUI's "latent2rgb" preview), a few multiply-adds per latent
pixel. Each family declares its map with its record (``Family.preview``, ``runner_service.families``); the
factors are those fitted for the VAE the family's checkpoints use. They apply to the latents as the
denoiser sees them (the VAE's output scaled by its scaling factor, and shifted for SD3 and Flux),
the space they were fitted in, and give RGB in about [-1, 1], mapped to [0, 255] here. A model
whose latents have other channels than its family's map (the tiny random builds of SD3 and Flux)
sends none, as a family without a map does.

A request asks for 0 to ``MAX_PARTIAL_IMAGES`` previews of each image; they are taken after
evenly spaced steps (``preview_steps``), never after the last, whose latents become the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

RGB = tuple[float, float, float]


@dataclass(frozen=True)
class LatentPreview:
    """One family's latent-to-RGB map: an (R, G, B) row per latent channel, and a bias."""

    factors: tuple[RGB, ...]
    bias: RGB = (0.0, 0.0, 0.0)

    @property
    def channels(self) -> int:
        return len(self.factors)

    def pixels(self, latents: torch.Tensor) -> np.ndarray | None:
        """n x h x w x 3 uint8 previews of n x C x h x w latents; None where C is not this map's."""
        if latents.ndim != 4 or latents.shape[1] != self.channels:
            return None
        factors = torch.tensor(self.factors, dtype=torch.float32, device=latents.device)
        bias = torch.tensor(self.bias, dtype=torch.float32, device=latents.device)
        rgb = torch.einsum("nchw,ck->nhwk", latents.float(), factors) + bias
        return ((rgb + 1) * 127.5).clamp(0, 255).round().to(torch.uint8).cpu().numpy()


@dataclass(frozen=True)
class Preview:
    """One preview of one image of a request."""

    request_id: str
    image_index: int  # within its item
    partial_image_index: int  # which of the item's partial_images, from 0
    pixels: np.ndarray  # h x w x 3 uint8, at the latent resolution


@dataclass(frozen=True)
class PreviewTarget:
    """An image that may take previews: its request, its index within its item, how many it asked for."""

    request_id: str
    image_index: int
    count: int


def preview_steps(total: int, count: int) -> tuple[int, ...]:
    """The steps done after which an image of ``total`` steps takes its ``count`` previews: the
    evenly spaced (k + 1) x total / (count + 1), rounded, from 1 to total - 1; fewer than ``count``
    where the schedule is too short to space them."""
    return tuple(sorted({round((k + 1) * total / (count + 1)) for k in range(count)} - {0, total}))


def partial_index(done: int, total: int, count: int) -> int | None:
    """Which of its previews an image takes after ``done`` of ``total`` steps; None: none then."""
    steps = preview_steps(total, count) if count else ()
    return steps.index(done) if done in steps else None


def take_previews(preview: LatentPreview | None, targets: Sequence[PreviewTarget], latents: torch.Tensor,
                  done: int, total: int) -> list[Preview]:
    """The previews the images of ``latents`` (a row each, n x C x h x w, ``targets`` in the same
    order) take after ``done`` of ``total`` steps; none where the model has no map that fits."""
    due = [(row, target, index) for row, target in enumerate(targets)
           if (index := partial_index(done, total, target.count)) is not None]
    if preview is None or not due:
        return []
    pixels = preview.pixels(latents[[row for row, _, _ in due]])
    if pixels is None:
        return []
    return [Preview(target.request_id, target.image_index, index, image)
            for (_, target, index), image in zip(due, pixels, strict=True)]
