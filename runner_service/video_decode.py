"""A video's VAE decode, tiled within a memory budget and counted call by call.

A video decode is where video serving runs out of memory: the whole video's latents go through
the VAE decoder at full resolution. Wan's ``AutoencoderKLWan`` decodes latent frame by latent
frame (a causal cache carries what it needs of the frames before), and with tiling on, tile by
tile of each frame, so its peak is the decoder's working set for one tile of one latent frame
plus the decoded video it assembles. ``decoding`` sets the tile size for one pipeline call (from
``--decode-budget-bytes``, or diffusers' default tiling), restores the VAE's own settings after
it, and calls back after every decoder call: the DECODING progress, and where the caller stops a
cancelled run between two decoder calls.

The estimate of a decode's peak (``DecodeEstimate``) was calibrated on CPU, float32, by the
growth of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over one decode in a
fresh process, three runs each, for two decoders: the tiny build's (3 channels; 17 frames of
256x256: untiled 220-230 MiB, tiles of 128 pixels 122-165, of 64 85-97, of 32 79-81) and Wan 2.1's
config (384 channels at its widest, 280 MiB of decoder weights; 5 frames of 128x128: untiled
533-664 MiB, tiles of 64 245-329, of 32 164-176). Per tile pixel the peak grew by up to 5,900 bytes
(tiny) and 51,000 (Wan 2.1) between the smaller tiles, less between the larger ones (the allocator
keeps small blocks), so the estimate, linear in the tile's pixels at the steeper rate, is within
about 10% for small tiles and errs high for large ones (untiled by 40-90%): a budget may get
smaller tiles than it needed, rarely larger. What does not shrink with the tiles is the decoded
video's copies and about half the decoder's weights again (the convolutions' reordered copies).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

# The decoded video is held as float copies of frames x height x width x 3 at its peak: the tiles'
# outputs, their concatenation, the clamp, the pipeline's postprocessing and the conversion to uint8
# (``device_output``: one float32 copy, on the video's device; calibrated when it was made on the host
# from diffusers' numpy output, in three copies, so the count errs high).
OUTPUT_COPIES = 6
# The decoder's working set for one tile of one latent frame (four frames out), in elements per tile
# pixel: a part of any width plus a part per channel of the decoder's widest level (its activations
# and the causal cache of two frames per convolution).
PIXEL_ELEMENTS = 1400
CHANNEL_ELEMENTS = 30
# The decoder's weights reordered for its convolutions, as a fraction of its weight bytes.
WEIGHT_COPIES = 1 / 2
# Tile sides step by this (a multiple of the VAE's x8 whose three quarters, the stride, is one too).
TILE_STEP = 32
# Diffusers' own tiles overlap by a quarter: the stride is three quarters of the tile.
STRIDE_NUMERATOR, STRIDE_DENOMINATOR = 3, 4

DecoderCall = Callable[[int, int], None]  # called with the decoder calls done and in all after each


@dataclass(frozen=True)
class Tiling:
    """The tiles of a decode, in output pixels; ``tile`` 0: the frame is decoded whole."""

    tile: int
    stride: int


@dataclass(frozen=True)
class DecodeEstimate:
    """The estimated peak bytes of decoding a video of ``frames`` x ``height`` x ``width`` with a
    decoder of ``channels`` channels at its widest, ``weight_bytes`` of weights and elements of
    ``element_bytes``."""

    frames: int
    height: int
    width: int
    channels: int
    weight_bytes: int
    element_bytes: int

    def peak(self, tiling: Tiling) -> int:
        """The video's copies and the decoder's reordered weights, plus the working set of one tile
        (the whole frame untiled)."""
        video = OUTPUT_COPIES * self.frames * self.height * self.width * 3 * self.element_bytes
        pixels = tiling.tile * tiling.tile if tiling.tile else self.height * self.width
        working = (PIXEL_ELEMENTS + CHANNEL_ELEMENTS * self.channels) * pixels * self.element_bytes
        return video + int(WEIGHT_COPIES * self.weight_bytes) + working

    def tiling_within(self, budget: int) -> Tiling | None:
        """The largest tiles whose decode stays within ``budget`` bytes (untiled where the whole
        frame does), or None where even the smallest tiles exceed it."""
        whole = Tiling(0, 0)
        if self.peak(whole) <= budget:
            return whole
        side = (max(self.height, self.width) - 1) // TILE_STEP * TILE_STEP
        while side >= TILE_STEP:
            tiling = Tiling(side, side * STRIDE_NUMERATOR // STRIDE_DENOMINATOR)
            if self.peak(tiling) <= budget:
                return tiling
            side -= TILE_STEP
        return None


def estimate(vae: Any, frames: int, height: int, width: int) -> DecodeEstimate | None:
    """The decode estimate for Wan's VAE; None for a VAE it was not calibrated on."""
    if not isinstance(vae, AutoencoderKLWan):
        return None
    config = vae.config
    base = config.decoder_base_dim or config.base_dim
    channels = base * max(config.dim_mult)
    weights = sum(parameter.numel() * parameter.element_size() for parameter in vae.decoder.parameters())
    return DecodeEstimate(frames, height, width, channels, weights, torch.finfo(vae.dtype).bits // 8)


def decoder_calls(vae: Any, frames: int, height: int, width: int) -> int:
    """How many times Wan's VAE (``AutoencoderKLWan``) calls its decoder for one video: once per
    latent frame, of each tile where it tiles (as its ``_decode`` and ``tiled_decode`` loop)."""
    latent_frames = (frames - 1) // int(vae.config.scale_factor_temporal) + 1
    ratio = int(vae.spatial_compression_ratio)
    latent_height, latent_width = height // ratio, width // ratio
    tile_height, tile_width = int(vae.tile_sample_min_height) // ratio, int(vae.tile_sample_min_width) // ratio
    if not vae.use_tiling or (latent_width <= tile_width and latent_height <= tile_height):
        return latent_frames
    rows = len(range(0, latent_height, int(vae.tile_sample_stride_height) // ratio))
    columns = len(range(0, latent_width, int(vae.tile_sample_stride_width) // ratio))
    return latent_frames * rows * columns


TILE_FIELDS = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width",
                "tile_sample_stride_height", "tile_sample_stride_width")


@contextlib.contextmanager
def decoding(vae: Any, tiling: Tiling | None, frames: int, height: int, width: int,
             on_call: DecoderCall) -> Iterator[None]:
    """Within: the VAE tiles as ``tiling`` says (None: diffusers' default tiles; ``Tiling(0, 0)``:
    no tiles), and ``on_call`` follows every decoder call (an exception it raises stops the
    decode). Where the VAE is not Wan's, its own settings stand and the total is the calls so far."""
    wan = isinstance(vae, AutoencoderKLWan)
    saved = {name: getattr(vae, name) for name in TILE_FIELDS} if wan else {}
    if wan:
        if tiling is None:
            vae.enable_tiling()
        elif tiling.tile:
            vae.enable_tiling(tiling.tile, tiling.tile, tiling.stride, tiling.stride)
        else:
            vae.use_tiling = False
    total = decoder_calls(vae, frames, height, width) if wan else 0
    done = 0

    def called(module: torch.nn.Module, arguments: Any, output: Any) -> None:
        nonlocal done
        done += 1
        on_call(done, max(total, done))

    hook = vae.decoder.register_forward_hook(called)
    try:
        yield
    finally:
        hook.remove()
        for name, value in saved.items():
            setattr(vae, name, value)


def tiles_within(vae: Any, budget: int, frames: int, height: int, width: int) -> Tiling | None:
    """The tiling a decode gets: diffusers' default (None) without a budget or an estimate for this
    VAE; else the largest within ``budget``. Raises ``DecodeOverBudget`` where none fits."""
    found = estimate(vae, frames, height, width) if budget else None
    if found is None:
        return None
    tiling = found.tiling_within(budget)
    if tiling is None:
        smallest = found.peak(Tiling(TILE_STEP, TILE_STEP * STRIDE_NUMERATOR // STRIDE_DENOMINATOR))
        raise DecodeOverBudget(f"decoding {frames} frames of {width}x{height} needs about "
                               f"{math.ceil(smallest / 2**20)} MiB even in the smallest tiles; this runner's "
                               f"--decode-budget-bytes is {math.ceil(budget / 2**20)} MiB")
    return tiling


class DecodeOverBudget(Exception):
    """A video whose decode would exceed ``--decode-budget-bytes`` in any tiles; nothing was run."""
