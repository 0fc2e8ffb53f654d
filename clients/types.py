"""What the sync and asyncio clients share: request building, result types and conversions.

Nothing here talks to the network; ``clients.client`` and ``clients.aio`` only add the calls.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from grpc_health.v1 import health_pb2

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.protocol import DTYPES

if TYPE_CHECKING:  # Pillow and numpy are imported when an image is converted, not before.
    import numpy as np
    from PIL import Image as PILImage

DEFAULT_TARGET = "127.0.0.1:50051"

OUTPUT_FORMATS: dict[str, int] = {
    "png": worker_pb2.OUTPUT_FORMAT_PNG,
    "jpeg": worker_pb2.OUTPUT_FORMAT_JPEG,
    "webp": worker_pb2.OUTPUT_FORMAT_WEBP,
    "raw": worker_pb2.OUTPUT_FORMAT_RAW,
}
_ENCODED_MIME_TYPES = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp"}


@dataclass(frozen=True)
class GeneratedImage:
    """One generated image: encoded bytes (PNG, JPEG, WebP) or raw height x width x 3 uint8 pixels."""

    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int

    def __repr__(self) -> str:  # the bytes are summarised: print(result) stays one short line
        return f"GeneratedImage({self.width}x{self.height} {self.mime_type}, {len(self.data)} bytes, seed {self.seed})"

    @property
    def is_raw(self) -> bool:
        """True for OUTPUT_FORMAT_RAW pixels, False for an encoded image."""
        return self.mime_type not in _ENCODED_MIME_TYPES and len(self.data) == self.width * self.height * 3

    @property
    def extension(self) -> str:
        """The usual file extension for the data (".raw" for raw pixels)."""
        return _ENCODED_MIME_TYPES.get(self.mime_type, ".raw")

    def to_numpy(self) -> np.ndarray:
        """The pixels as a height x width x 3 uint8 array (decoded with Pillow when encoded)."""
        import numpy as np

        if self.is_raw:
            return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, 3)
        return np.asarray(self.to_pil().convert("RGB"))

    def to_pil(self) -> PILImage.Image:
        """The image as a Pillow image (RGB)."""
        from PIL import Image

        if self.is_raw:
            return Image.fromarray(self.to_numpy(), mode="RGB")
        image = Image.open(io.BytesIO(self.data))
        image.load()
        return image

    @classmethod
    def from_proto(cls, image: worker_pb2.Image) -> GeneratedImage:
        return cls(data=image.data, mime_type=image.mime_type, width=image.width,
                   height=image.height, seed=image.seed)


@dataclass(frozen=True)
class Timings:
    """Where the time of one request went, in milliseconds, as the worker measured it."""

    queue_ms: float = 0.0
    execute_ms: float = 0.0
    encode_ms: float = 0.0
    total_ms: float = 0.0

    @classmethod
    def from_proto(cls, timings: worker_pb2.Timings) -> Timings:
        return cls(queue_ms=timings.queue_ms, execute_ms=timings.execute_ms,
                   encode_ms=timings.encode_ms, total_ms=timings.total_ms)


@dataclass(frozen=True)
class GenerateResult:
    """The result of one Generate call (or the Done event of a stream)."""

    request_id: str
    images: list[GeneratedImage]
    weights_version: str
    timings: Timings
    model: str

    @classmethod
    def from_proto(cls, response: worker_pb2.GenerateResponse) -> GenerateResult:
        return cls(
            request_id=response.request_id,
            images=[GeneratedImage.from_proto(image) for image in response.images],
            weights_version=response.weights_version,
            timings=Timings.from_proto(response.timings),
            model=response.model,
        )


@dataclass(frozen=True)
class PushResult:
    """What a PushWeights applied: the new weights version, the model's checksum after it, the
    tensor names (sorted) and the bytes received."""

    weights_version: str
    checksum: str
    loaded_names: tuple[str, ...]
    bytes_received: int

    def __repr__(self) -> str:  # the names are counted: print(result) stays one short line
        return (f"PushResult(weights {self.weights_version}, checksum {self.checksum}, {self.tensors} tensors, "
                f"{self.bytes_received} bytes)")

    @property
    def tensors(self) -> int:
        """How many tensors were applied."""
        return len(self.loaded_names)

    @classmethod
    def from_proto(cls, response: worker_pb2.PushWeightsResponse) -> PushResult:
        return cls(weights_version=response.weights_version, checksum=response.checksum,
                   loaded_names=tuple(response.loaded_names), bytes_received=response.bytes_received)


@dataclass(frozen=True)
class Queued:
    """The request waits in the worker's queue; position 0 means next in line."""

    request_id: str
    position: int


@dataclass(frozen=True)
class Started:
    """The request left the queue and is running."""

    request_id: str


@dataclass(frozen=True)
class Progress:
    """Denoising step ``step`` of ``total`` is done (1-based)."""

    step: int
    total: int


@dataclass(frozen=True)
class Done:
    """The last event of a stream: the result."""

    result: GenerateResult


Event = Queued | Started | Progress | Done


def event_from_proto(response: worker_pb2.GenerateStreamResponse) -> Event:
    kind = response.WhichOneof("event")
    if kind == "queued":
        return Queued(request_id=response.queued.request_id, position=response.queued.position)
    if kind == "started":
        return Started(request_id=response.started.request_id)
    if kind == "progress":
        return Progress(step=response.progress.step, total=response.progress.total_steps)
    if kind == "done":
        return Done(result=GenerateResult.from_proto(response.done))
    raise ValueError(f"unknown stream event {kind!r}")


# {name: scale}, or a sequence of names (scale 1) and (name, scale) pairs.
Adapters = Mapping[str, float] | Iterable[str | tuple[str, float]]


def adapter_refs(adapters: Adapters) -> list[common_pb2.AdapterRef]:
    """The adapters of a request, in order; a name alone leaves its scale unset (1.0 on the worker)."""
    if isinstance(adapters, Mapping):
        return [common_pb2.AdapterRef(name=name, scale=scale) for name, scale in adapters.items()]
    if isinstance(adapters, str):  # one name, not a sequence of one-letter names
        adapters = [adapters]
    return [common_pb2.AdapterRef(name=item) if isinstance(item, str)
            else common_pb2.AdapterRef(name=item[0], scale=item[1]) for item in adapters]


# An input image: encoded bytes (PNG, JPEG, WebP), a path to such a file, a PIL image, or a
# height x width x 3 (or x 1 / 2-D, for a mask) uint8 numpy array.
ImageInput = bytes | str | os.PathLike[str] | Any

TASKS: dict[str, int] = {
    "text-to-image": common_pb2.TASK_TEXT_TO_IMAGE,
    "image-to-image": common_pb2.TASK_IMAGE_TO_IMAGE,
    "inpaint": common_pb2.TASK_INPAINT,
    "edit": common_pb2.TASK_EDIT,
}
RESIZE_MODES: dict[str, int] = {"resize": worker_pb2.RESIZE_MODE_RESIZE, "crop": worker_pb2.RESIZE_MODE_CROP}


def image_bytes(image: ImageInput) -> bytes:
    """The bytes a request carries for ``image``: encoded bytes as they are, a file's contents, and
    a PIL image or numpy array as PNG (lossless)."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        with open(image, "rb") as file:
            return file.read()
    from PIL import Image

    if not isinstance(image, Image.Image):
        import numpy as np

        array = np.asarray(image)
        if array.dtype != np.uint8:
            raise TypeError(f"an image array must be uint8, got {array.dtype}")
        image = Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _named(value: str | int, names: Mapping[str, int], what: str) -> int:
    if isinstance(value, int):
        return value
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; choose from {sorted(names)}")
    return names[value]


def build_generate_request(
    prompt: str,
    *,
    negative_prompt: str = "",
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    true_cfg_scale: float | None = None,
    cache_threshold: float | None = None,
    seed: int | None = None,
    num_images: int | None = None,
    output_format: str | int = "png",
    request_id: str = "",
    adapters: Adapters = (),
    image: ImageInput | None = None,
    mask: ImageInput | None = None,
    strength: float | None = None,
    task: str | int = 0,
    resize_mode: str | int = 0,
) -> worker_pb2.GenerateRequest:
    """A GenerateRequest; None leaves a field to the worker's default (see worker.proto).

    ``output_format`` is "png", "jpeg", "webp", "raw" or an ``OutputFormat`` value. ``adapters``
    are LoRA adapters registered with ``load_adapter``: ``{"style": 0.8}``, ``["style"]`` or
    ``[("style", 0.8)]``. ``image`` and ``mask`` (bytes, a path, a PIL image or a numpy array)
    make it image-to-image, inpainting or an edit (the task follows from them unless ``task``,
    one of ``TASKS``, says it); ``resize_mode`` "resize" or "crop" fits an image of another size.
    ``true_cfg_scale`` is true classifier-free guidance for the models whose capabilities report
    ``true_cfg`` (Flux: above 1, with a ``negative_prompt``). ``cache_threshold`` overrides the step
    cache's threshold of a model loaded with one (0: no caching for this request).
    Nothing is validated here: the worker answers INVALID_ARGUMENT with one field violation per
    bad field.
    """
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        negative_prompt=negative_prompt,
        width=width or 0,
        height=height or 0,
        num_inference_steps=steps or 0,
        num_images=num_images or 0,
        output_format=cast("worker_pb2.OutputFormat", output_format_value(output_format)),
        adapters=adapter_refs(adapters),
        image=image_bytes(image) if image is not None else b"",
        mask_image=image_bytes(mask) if mask is not None else b"",
        task=cast("common_pb2.Task", _named(task, TASKS, "task")),
        resize_mode=cast("worker_pb2.ResizeMode", _named(resize_mode, RESIZE_MODES, "resize mode")),
    )
    if strength is not None:
        request.strength = strength
    if guidance_scale is not None:
        request.guidance_scale = guidance_scale
    if true_cfg_scale is not None:
        request.true_cfg_scale = true_cfg_scale
    if cache_threshold is not None:
        request.cache_threshold = cache_threshold
    if seed is not None:
        request.seed = seed
    return request


def output_format_value(output_format: str | int) -> int:
    if isinstance(output_format, str):
        try:
            return OUTPUT_FORMATS[output_format.lower()]
        except KeyError:
            raise ValueError(f"output_format must be one of {sorted(OUTPUT_FORMATS)}") from None
    return int(output_format)


def build_init_request(model: str, dtype: str | int | None = None,
                       acceleration: common_pb2.Acceleration | Mapping[str, Any] | None = None
                       ) -> worker_pb2.InitRequest:
    """An InitRequest; ``dtype`` is "float32", "float16", "bfloat16", a ``Dtype`` value or None;
    ``acceleration`` an ``Acceleration`` or its fields (``{"cache": "first_block_cache",
    "cache_threshold": 0.2}``; see docs/acceleration.md)."""
    if not isinstance(acceleration, common_pb2.Acceleration):
        acceleration = common_pb2.Acceleration(**(acceleration or {}))
    if dtype is None:
        value: int = common_pb2.DTYPE_UNSPECIFIED
    elif isinstance(dtype, str):
        try:
            value = DTYPES[dtype.lower()]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}") from None
    else:
        value = int(dtype)
    return worker_pb2.InitRequest(model=model, dtype=cast("common_pb2.Dtype", value), acceleration=acceleration)


def build_sleep_request(level: int = 1, tags: Iterable[str] = ()) -> worker_pb2.SleepRequest:
    return worker_pb2.SleepRequest(level=level, tags=list(tags))


def build_wake_request(tags: Iterable[str] = ()) -> worker_pb2.WakeUpRequest:
    return worker_pb2.WakeUpRequest(tags=list(tags))


def health_name(response: health_pb2.HealthCheckResponse) -> str:
    """"SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name
