"""Image encoding of a request's results: PNG, JPEG, lossless WEBP, or raw pixels passed through.

The images of a request are encoded in parallel on one bounded thread pool shared by all requests
(the encoders release the GIL), off the event loop; the encoder per format is in
``worker_service.pixel_encoders``. Each image's generation parameters, when given, are written into
its file (``embedded_parameters``) and set as its ``parameters`` object.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from diffusion.v1 import runner_pb2, worker_pb2
from worker_service.embedded_parameters import with_parameters
from worker_service.image_parameters import ImageParameters
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
                 encoders: dict[int, PixelEncoder] = FASTEST, parameters: str = "") -> bytes:
    """The bytes of one image in ``output_format``, with the ``parameters`` text in the file when
    set; RAW returns the runner's pixels unchanged."""
    expected = raw.width * raw.height * raw.channels
    if len(raw.pixels) != expected:
        raise ValueError(f"runner sent {len(raw.pixels)} bytes for a {raw.width}x{raw.height}x{raw.channels} image")
    if output_format == worker_pb2.OUTPUT_FORMAT_RAW:
        return raw.pixels
    if output_format == worker_pb2.OUTPUT_FORMAT_UNSPECIFIED:
        output_format = worker_pb2.OUTPUT_FORMAT_PNG
    shape = (raw.height, raw.width) if raw.channels == 1 else (raw.height, raw.width, raw.channels)
    data = encoders[output_format](np.frombuffer(raw.pixels, np.uint8).reshape(shape))
    return with_parameters(data, output_format, parameters, raw.width, raw.height) if parameters else data


async def encode_images(raws: list[runner_pb2.RawImage], output_format: int, seeds: list[int],
                        parameters: Sequence[ImageParameters] | None = None) -> list[worker_pb2.Image]:
    """Every image of one request, encoded in parallel threads, in the order of ``raws``, with the
    ``parameters`` of each (None: none written)."""
    if output_format == worker_pb2.OUTPUT_FORMAT_RAW:  # passed through: a thread's hand-off would be all it costs
        data = [encode_image(raw, output_format) for raw in raws]
    else:
        loop = asyncio.get_running_loop()
        texts = [p.as_text() for p in parameters] if parameters is not None else [""] * len(raws)
        data = await asyncio.gather(*(loop.run_in_executor(_POOL, encode_image, raw, output_format, FASTEST, text)
                                      for raw, text in zip(raws, texts, strict=True)))
    mime_type = MIME_TYPES[output_format]
    images = [worker_pb2.Image(data=encoded, mime_type=mime_type, width=raw.width, height=raw.height, seed=seed)
              for raw, encoded, seed in zip(raws, data, seeds, strict=True)]
    if parameters is not None:
        for image, described in zip(images, parameters, strict=True):
            image.parameters.update(described.as_json())
    return images
