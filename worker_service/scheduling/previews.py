"""The previews of a runner's progress event (``ExecuteProgress.previews``), checked and encoded
for each request's own progress event (``ProgressEvent.previews``).

The runner sends each preview as raw pixels at the latent resolution; the worker encodes it in the
request's output format (PNG for raw: a preview is for showing), on the encoding threads. A preview
that the request did not ask for, or larger than its image, is dropped with an error in the log
(the request goes on without it): what the worker holds stays bounded by what the request asked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from diffusion.v1 import runner_pb2, worker_pb2
from serving_common.protocol import image_seed
from worker_service.encoding import encode_images
from worker_service.validation import NormalizedRequest

logger = logging.getLogger(__name__)

_SHOWN_AS_PNG = (worker_pb2.OUTPUT_FORMAT_UNSPECIFIED, worker_pb2.OUTPUT_FORMAT_RAW)


@dataclass(frozen=True)
class RequestPreviews:
    """One request's previews of one step, encoded, in the order of its images."""

    partial_image_index: int
    images: list[worker_pb2.Image]


def preview_problem(preview: runner_pb2.PreviewImage, request: NormalizedRequest) -> str | None:
    """What is wrong with a preview the runner sent for ``request``; None when it is one it asked for."""
    image = preview.image
    if preview.image_index >= request.num_images or preview.partial_image_index >= request.partial_images:
        return (f"preview {preview.partial_image_index} of image {preview.image_index}, of a request of "
                f"{request.num_images} image(s) that asked for {request.partial_images} preview(s)")
    if (image.channels != 3 or not 0 < image.width <= request.width or not 0 < image.height <= request.height
            or len(image.pixels) != image.width * image.height * 3):
        return (f"a {image.width}x{image.height}x{image.channels} preview in {len(image.pixels)} bytes of a "
                f"{request.width}x{request.height} image")
    return None


async def encoded_previews(progress: runner_pb2.ExecuteProgress,
                           requests: Mapping[str, NormalizedRequest]) -> dict[str, RequestPreviews]:
    """The step's previews by request id, of the ``requests`` still waiting for them."""
    found: dict[str, list[runner_pb2.PreviewImage]] = {}
    for preview in progress.previews:
        request = requests.get(preview.request_id)
        if request is None:
            continue
        problem = preview_problem(preview, request)
        if problem is not None:
            logger.error("request %s: the runner sent %s; dropped", request.request_id, problem)
            continue
        found.setdefault(request.request_id, []).append(preview)
    encoded = {}
    for request_id, previews in found.items():
        request = requests[request_id]
        previews.sort(key=lambda preview: preview.image_index)
        output_format = (worker_pb2.OUTPUT_FORMAT_PNG if request.output_format in _SHOWN_AS_PNG
                         else request.output_format)
        images = await encode_images([preview.image for preview in previews], output_format,
                                     [image_seed(request.seed, preview.image_index) for preview in previews])
        encoded[request_id] = RequestPreviews(previews[0].partial_image_index, images)
    return encoded
