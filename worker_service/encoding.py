"""Image encoding with Pillow: PNG, JPEG, WEBP, or raw pixels passed through. Runs in a thread."""

from __future__ import annotations

import asyncio
import io

from PIL import Image

from diffusion.v1 import runner_pb2, worker_pb2

MIME_TYPES: dict[int, str] = {
    worker_pb2.OUTPUT_FORMAT_UNSPECIFIED: "image/png",
    worker_pb2.OUTPUT_FORMAT_PNG: "image/png",
    worker_pb2.OUTPUT_FORMAT_JPEG: "image/jpeg",
    worker_pb2.OUTPUT_FORMAT_WEBP: "image/webp",
    worker_pb2.OUTPUT_FORMAT_RAW: "application/octet-stream",
}

_PIL_MODES = {1: "L", 3: "RGB"}

# Pillow format name and save options per output format.
_SAVE_OPTIONS: dict[int, tuple[str, dict[str, object]]] = {
    worker_pb2.OUTPUT_FORMAT_UNSPECIFIED: ("PNG", {}),
    worker_pb2.OUTPUT_FORMAT_PNG: ("PNG", {}),
    worker_pb2.OUTPUT_FORMAT_JPEG: ("JPEG", {"quality": 95}),
    worker_pb2.OUTPUT_FORMAT_WEBP: ("WEBP", {"lossless": True}),
}


def encode_image(raw: runner_pb2.RawImage, output_format: int) -> bytes:
    """The bytes of one image in ``output_format``; RAW returns the runner's pixels unchanged."""
    expected = raw.width * raw.height * raw.channels
    if len(raw.pixels) != expected:
        raise ValueError(f"runner sent {len(raw.pixels)} bytes for a {raw.width}x{raw.height}x{raw.channels} image")
    if output_format == worker_pb2.OUTPUT_FORMAT_RAW:
        return raw.pixels
    image = Image.frombytes(_PIL_MODES[raw.channels], (raw.width, raw.height), raw.pixels)
    pil_format, options = _SAVE_OPTIONS[output_format]
    buffer = io.BytesIO()
    image.save(buffer, pil_format, **options)
    return buffer.getvalue()


def _encode_all(raws: list[runner_pb2.RawImage], output_format: int, seeds: list[int]) -> list[worker_pb2.Image]:
    mime_type = MIME_TYPES[output_format]
    return [
        worker_pb2.Image(data=encode_image(raw, output_format), mime_type=mime_type,
                         width=raw.width, height=raw.height, seed=seed)
        for raw, seed in zip(raws, seeds, strict=True)
    ]


async def encode_images(raws: list[runner_pb2.RawImage], output_format: int,
                        seeds: list[int]) -> list[worker_pb2.Image]:
    """Encodes every image of one request in a worker thread, off the event loop."""
    return await asyncio.to_thread(_encode_all, raws, output_format, seeds)
