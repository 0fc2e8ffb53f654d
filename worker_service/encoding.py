"""Image encoding of a request's results: PNG, JPEG, lossless WEBP, or raw pixels passed through.

The images of a request are encoded in parallel on one bounded thread pool shared by all requests
(the encoders release the GIL), off the event loop; the encoder per format is in
``worker_service.pixel_encoders``.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from diffusion.v1 import runner_pb2, worker_pb2
from worker_service.pixel_encoders import FASTEST, PixelEncoder

MIME_TYPES: dict[int, str] = {
    worker_pb2.OUTPUT_FORMAT_UNSPECIFIED: "image/png",
    worker_pb2.OUTPUT_FORMAT_PNG: "image/png",
    worker_pb2.OUTPUT_FORMAT_JPEG: "image/jpeg",
    worker_pb2.OUTPUT_FORMAT_WEBP: "image/webp",
    worker_pb2.OUTPUT_FORMAT_RAW: "application/octet-stream",
}

# One thread per core: more would only make the encodes of one batch finish later together.
_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="encode")


def encode_image(raw: runner_pb2.RawImage, output_format: int,
                 encoders: dict[int, PixelEncoder] = FASTEST) -> bytes:
    """The bytes of one image in ``output_format``; RAW returns the runner's pixels unchanged."""
    expected = raw.width * raw.height * raw.channels
    if len(raw.pixels) != expected:
        raise ValueError(f"runner sent {len(raw.pixels)} bytes for a {raw.width}x{raw.height}x{raw.channels} image")
    if output_format == worker_pb2.OUTPUT_FORMAT_RAW:
        return raw.pixels
    if output_format == worker_pb2.OUTPUT_FORMAT_UNSPECIFIED:
        output_format = worker_pb2.OUTPUT_FORMAT_PNG
    shape = (raw.height, raw.width) if raw.channels == 1 else (raw.height, raw.width, raw.channels)
    return encoders[output_format](np.frombuffer(raw.pixels, np.uint8).reshape(shape))


async def encode_images(raws: list[runner_pb2.RawImage], output_format: int,
                        seeds: list[int]) -> list[worker_pb2.Image]:
    """Every image of one request, encoded in parallel threads, in the order of ``raws``."""
    loop = asyncio.get_running_loop()
    data = await asyncio.gather(*(loop.run_in_executor(_POOL, encode_image, raw, output_format) for raw in raws))
    mime_type = MIME_TYPES[output_format]
    return [worker_pb2.Image(data=encoded, mime_type=mime_type, width=raw.width, height=raw.height, seed=seed)
            for raw, encoded, seed in zip(raws, data, seeds, strict=True)]
