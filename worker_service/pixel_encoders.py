"""Pixel encoders per output format: the fastest measured one that gives the same pixels back.

Chosen by ``benchmarks/bench_encoding.py`` (docs/benchmarks.md, "Output encoding"):

- PNG: imagecodecs' libpng with zlib's RLE strategy and the SUB filter. At 1024x1024 it takes
  about a third of Pillow's default (compress level 6, every filter tried per row) and its files
  are smaller than Pillow's level 1; Pillow at level 1 with the RLE strategy is the fallback when
  imagecodecs is not installed.
- Lossless WebP: libwebp (through Pillow) at method 0: tens of times faster than Pillow's
  default method 4, for files about a fifth larger.
- JPEG: Pillow at quality 95 (a few milliseconds already).

Every encoder takes an (H, W) grayscale or (H, W, 3) RGB uint8 array and releases the GIL while
it compresses, so a batch's images can be encoded by parallel threads.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image

from diffusion.v1 import worker_pb2

PixelEncoder = Callable[[np.ndarray], bytes]

_Z_RLE = 3  # zlib's Z_RLE strategy (Pillow's compress_type)


def _pillow(pil_format: str, **options: object) -> PixelEncoder:
    def encode(pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, pil_format, **options)
        return buffer.getvalue()
    return encode


# Pillow only: every format, and the fallback when imagecodecs is missing.
PILLOW: dict[int, PixelEncoder] = {
    worker_pb2.OUTPUT_FORMAT_PNG: _pillow("PNG", compress_level=1, compress_type=_Z_RLE),
    worker_pb2.OUTPUT_FORMAT_JPEG: _pillow("JPEG", quality=95),
    worker_pb2.OUTPUT_FORMAT_WEBP: _pillow("WEBP", lossless=True, method=0, quality=0),
}


def _fastest() -> dict[int, PixelEncoder]:
    try:
        import imagecodecs
    except ImportError:
        return dict(PILLOW)

    def png(pixels: np.ndarray) -> bytes:
        return bytes(imagecodecs.png_encode(pixels, level=1, strategy=imagecodecs.PNG.STRATEGY.RLE,
                                            filter=imagecodecs.PNG.FILTER.SUB))
    return {**PILLOW, worker_pb2.OUTPUT_FORMAT_PNG: png}


# What the worker uses: the fastest installed encoder per format.
FASTEST: dict[int, PixelEncoder] = _fastest()
