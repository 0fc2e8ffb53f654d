"""Pixel encoders per output format: the fastest measured one that gives the same pixels back.

Chosen by ``benchmarks/bench_encoding.py`` (docs/benchmarks.md, "Output encoding"):

- PNG: imagecodecs' libpng at level 1 with zlib's RLE strategy and the SUB filter on every row.
  At 1024x1024 it takes about a third of Pillow's level 1's time and a tenth or less of Pillow's default's
  (level 6), for files as small as level 6's on smooth pictures and twice its size (still tens of
  KiB) on flat shapes. Most of Pillow's time is its choice of the best of five filters per row.
  The fallback when imagecodecs is not installed: Pillow at level 1 with the RLE strategy.
- Lossless WebP: libwebp (through Pillow) at method 1, quality (effort) 0: about a third of the
  default's (method 4, quality 80) time, for files within 1% of its size. Method 0 is three to five
  times faster again but its files are a fifth larger: larger than the PNG.
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
    worker_pb2.OUTPUT_FORMAT_WEBP: _pillow("WEBP", lossless=True, method=1, quality=0),
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
