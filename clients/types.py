"""What the sync and asyncio clients share: request building, result types and conversions.

Nothing here talks to the network; ``clients.client`` and ``clients.aio`` only add the calls.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc
from grpc_health.v1 import health_pb2

from clients.conditioning import Control, ImagePrompt, control_inputs, image_prompt
from clients.errors import DiffusionError
from clients.local_checks import check_generate
from diffusion.v1 import common_pb2, worker_pb2
from serving_common.conditioning_rules import KINDS
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
    "mp4": worker_pb2.OUTPUT_FORMAT_MP4,
}
# The formats of each kind of result (raw: pixels as the runner made them, for both).
IMAGE_FORMATS = ("jpeg", "png", "raw", "webp")
VIDEO_FORMATS = ("mp4", "raw", "webp")
_ENCODED_MIME_TYPES = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp"}
_VIDEO_MIME_TYPES = {"video/mp4": ".mp4", "image/webp": ".webp"}


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
    transfer_ms: float = 0.0  # the Execute call's time beyond the runner's execute_ms
    # The runner's phases of the batch (0: a phase it did not go through or could not tell apart).
    text_encode_ms: float = 0.0
    denoise_ms: float = 0.0
    decode_ms: float = 0.0
    to_host_ms: float = 0.0

    @classmethod
    def from_proto(cls, timings: worker_pb2.Timings) -> Timings:
        runner = timings.runner
        return cls(queue_ms=timings.queue_ms, execute_ms=timings.execute_ms,
                   encode_ms=timings.encode_ms, total_ms=timings.total_ms, transfer_ms=timings.transfer_ms,
                   text_encode_ms=runner.text_encode_ms, denoise_ms=runner.denoise_ms,
                   decode_ms=runner.decode_ms, to_host_ms=runner.to_host_ms)


def malformed(message: str) -> DiffusionError:
    """The error of a response that breaks the protocol (chunks out of order, a video's size and
    bytes that disagree): DATA_LOSS, a ``DiffusionError`` like every other failed call."""
    return DiffusionError(grpc.StatusCode.DATA_LOSS, message)


# A streamed video's bytes put together, by (video index, frames): Video.data (False) or
# Video.frames (True).
VideoBytes = Mapping[tuple[int, bool], bytes | bytearray]


@dataclass(frozen=True)
class VideoResult:
    """One generated video: ``data``, the container (MP4, animated WebP, or with raw output the frames
    themselves), and ``frames``, its num_frames x height x width x 3 uint8 pixels as the runner made
    them (None when the request asked for none: ``generate`` without ``return_frames``)."""

    request_id: str
    data: bytes
    mime_type: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    frames: np.ndarray | None = field(compare=False)
    timings: Timings
    model: str
    weights_version: str

    def __repr__(self) -> str:  # the bytes are summarised: print(result) stays one short line
        return (f"VideoResult({self.num_frames} frames {self.width}x{self.height} at {self.fps} fps, "
                f"{self.mime_type}, {len(self.data)} bytes, seed {self.seed}, request {self.request_id})")

    @property
    def extension(self) -> str:
        """The usual file extension for the data (".raw" for raw frames)."""
        return _VIDEO_MIME_TYPES.get(self.mime_type, ".raw")

    @classmethod
    def from_proto(cls, response: worker_pb2.GenerateResponse, index: int,
                   streamed: VideoBytes | None = None) -> VideoResult:
        """Video ``index`` of ``response``, its bytes from the response itself (Generate) or from
        ``streamed`` (GenerateStream, whose done event carries none)."""
        import numpy as np

        video = response.videos[index]
        data = bytes(streamed.get((index, False), b"")) if streamed is not None else video.data
        frame_bytes = streamed.get((index, True), b"") if streamed is not None else video.frames
        if not frame_bytes and video.mime_type not in _VIDEO_MIME_TYPES:
            frame_bytes = data  # raw output: the data are the frames
        shape = (video.num_frames, video.height, video.width, 3)
        frames = None
        if frame_bytes:
            if len(frame_bytes) != video.num_frames * video.height * video.width * 3:
                raise malformed(f"video {index} has {len(frame_bytes)} bytes of frames, not the "
                                f"{'x'.join(map(str, shape))} its size says")
            frames = np.frombuffer(frame_bytes, dtype=np.uint8).reshape(shape)
        return cls(request_id=response.request_id, data=data, mime_type=video.mime_type, width=video.width,
                   height=video.height, num_frames=video.num_frames, fps=video.fps, seed=video.seed,
                   frames=frames, timings=Timings.from_proto(response.timings), model=response.model,
                   weights_version=response.weights_version)


@dataclass(frozen=True)
class GenerateResult:
    """The result of one Generate call (or the Done event of a stream): images, or a video task's videos."""

    request_id: str
    images: list[GeneratedImage]
    weights_version: str
    timings: Timings
    model: str
    videos: list[VideoResult] = field(default_factory=list)

    @classmethod
    def from_proto(cls, response: worker_pb2.GenerateResponse, streamed: VideoBytes | None = None) -> GenerateResult:
        """``streamed``: the videos' bytes of a stream (see ``VideoResult.from_proto``)."""
        return cls(
            request_id=response.request_id,
            images=[GeneratedImage.from_proto(image) for image in response.images],
            weights_version=response.weights_version,
            timings=Timings.from_proto(response.timings),
            model=response.model,
            videos=[VideoResult.from_proto(response, i, streamed) for i in range(len(response.videos))],
        )

    def video(self) -> VideoResult:
        """The one video of a video request (which makes one), with its bytes."""
        if len(self.videos) != 1 or not self.videos[0].data:
            raise malformed(f"request {self.request_id} ended with {len(self.videos)} videos and "
                            f"{len(self.images)} images, not one video")
        return self.videos[0]


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


PHASES: dict[int, str] = {
    common_pb2.PROGRESS_PHASE_UNSPECIFIED: "denoising",  # what a worker from before videos sends
    common_pb2.PROGRESS_PHASE_DENOISING: "denoising",
    common_pb2.PROGRESS_PHASE_DECODING: "decoding",
    common_pb2.PROGRESS_PHASE_ENCODING: "encoding",
}


@dataclass(frozen=True)
class Progress:
    """Step ``step`` of ``total`` of ``phase`` is done (1-based): "denoising" steps, then for a video
    "decoding" (the VAE decoder's calls) and "encoding" (frames into the container). With
    ``partial_images``, a denoising step may bring ``previews``: preview ``partial_image_index`` of
    each image, small pictures of its latents (not the image decoded)."""

    step: int
    total: int
    phase: str = "denoising"
    previews: tuple[GeneratedImage, ...] = ()
    partial_image_index: int = 0


@dataclass(frozen=True)
class Chunk:
    """``data`` at ``offset`` of the ``total_bytes`` of video ``video_index``'s container (``frames``
    False) or raw frames (True): a stream sends a video's bytes in these before Done, and puts them
    together into Done's ``videos``."""

    video_index: int
    frames: bool
    offset: int
    data: bytes
    total_bytes: int

    def __repr__(self) -> str:  # the bytes are summarised: print(event) stays one short line
        return (f"Chunk(video {self.video_index} {'frames' if self.frames else 'data'}, "
                f"{self.offset}+{len(self.data)} of {self.total_bytes} bytes)")


@dataclass(frozen=True)
class Done:
    """The last event of a stream: the result."""

    result: GenerateResult


Event = Queued | Started | Progress | Chunk | Done
# generate_video's on_progress(phase, step, total), with a Progress event's fields.
VideoProgressCallback = Callable[[str, int, int], None]


def event_from_proto(response: worker_pb2.GenerateStreamResponse) -> Event:
    """One stream response as an event; a Done of a video stream needs its chunks (``StreamReader``)."""
    kind = response.WhichOneof("event")
    if kind == "queued":
        return Queued(request_id=response.queued.request_id, position=response.queued.position)
    if kind == "started":
        return Started(request_id=response.started.request_id)
    if kind == "progress":
        progress = response.progress
        return Progress(step=progress.step, total=progress.total_steps, phase=PHASES.get(progress.phase, "denoising"),
                        previews=tuple(GeneratedImage.from_proto(image) for image in progress.previews),
                        partial_image_index=progress.partial_image_index)
    if kind == "chunk":
        chunk = response.chunk
        return Chunk(video_index=chunk.video_index, frames=chunk.frames, offset=chunk.offset, data=chunk.data,
                     total_bytes=chunk.total_bytes)
    if kind == "done":
        return Done(result=GenerateResult.from_proto(response.done))
    raise ValueError(f"unknown stream event {kind!r}")


class StreamReader:
    """The events of one GenerateStream, each video's chunks put together so that Done holds whole
    videos (for the sync and asyncio streams alike).

    The worker sends each field's chunks in order; one that leaves a gap, overlaps, changes its
    ``total_bytes`` or would go past it is refused (DATA_LOSS) before it is kept, so what a stream
    holds never exceeds what its chunks announced and actually sent.
    """

    def __init__(self) -> None:
        self._fields: dict[tuple[int, bool], tuple[int, bytearray]] = {}

    def event(self, response: worker_pb2.GenerateStreamResponse) -> Event:
        if response.WhichOneof("event") == "done":
            return Done(result=GenerateResult.from_proto(response.done, self._whole(len(response.done.videos))))
        event = event_from_proto(response)
        if isinstance(event, Chunk):
            self._add(event)
        return event

    def _add(self, chunk: Chunk) -> None:
        key = (chunk.video_index, chunk.frames)
        total, buffer = self._fields.setdefault(key, (chunk.total_bytes, bytearray()))
        if chunk.total_bytes != total or chunk.offset != len(buffer) or len(buffer) + len(chunk.data) > total:
            raise malformed(f"{chunk!r} does not follow the {len(buffer)} of {total} bytes received")
        buffer += chunk.data

    def _whole(self, videos: int) -> dict[tuple[int, bool], bytearray]:
        """The fields streamed, each checked complete and of a video the result has."""
        for (index, frames), (total, buffer) in self._fields.items():
            if index >= videos or len(buffer) != total:
                raise malformed(f"video {index}'s {'frames' if frames else 'data'} ended at {len(buffer)} of "
                                f"{total} bytes, in a result of {videos} videos")
        return {key: buffer for key, (_, buffer) in self._fields.items()}


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
    "text-to-video": common_pb2.TASK_TEXT_TO_VIDEO,
    "image-to-video": common_pb2.TASK_IMAGE_TO_VIDEO,
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
    num_frames: int | None = None,
    fps: int | None = None,
    return_frames: bool = False,
    partial_images: int = 0,
    sampler: str = "",
    controls: Iterable[Control | Mapping[str, Any]] = (),
    ip_adapter: ImagePrompt | Mapping[str, Any] | None = None,
) -> worker_pb2.GenerateRequest:
    """A GenerateRequest; None leaves a field to the worker's default (see worker.proto).

    ``output_format`` is "png", "jpeg", "webp", "raw", "mp4" or an ``OutputFormat`` value. ``adapters``
    are LoRA adapters registered with ``load_adapter``: ``{"style": 0.8}``, ``["style"]`` or
    ``[("style", 0.8)]``. ``image`` and ``mask`` (bytes, a path, a PIL image or a numpy array)
    make it image-to-image, inpainting or an edit (the task follows from them unless ``task``,
    one of ``TASKS``, says it); ``resize_mode`` "resize" or "crop" fits an image of another size.
    ``true_cfg_scale`` is true classifier-free guidance for the models whose capabilities report
    ``true_cfg`` (Flux: above 1, with a ``negative_prompt``). ``cache_threshold`` overrides the step
    cache's threshold of a model loaded with one (0: no caching for this request). ``num_frames``,
    ``fps`` and ``return_frames`` are for video tasks (``build_video_request``). ``partial_images``
    (0 to 3; streams only) asks for previews of each image in the stream's Progress events.
    ``sampler`` names one of the model's samplers (its capabilities' ``samplers``: "euler_a",
    "dpmpp_2m_karras", ...); empty: the model's own scheduler.
    ``controls`` are up to 3 ControlNets (``clients.Control(name, image, scale, start, end)`` or dicts
    with those keys) and ``ip_adapter`` an image prompt (``clients.ImagePrompt(name, images, scale)``
    or a dict), each registered with ``load_adapter(..., kind=...)`` (docs/conditioning.md).
    A value the worker refuses whatever its flags and model (a seed outside 0 to 2^64-1, a count or
    size of 0 or less, a negative guidance...) raises ``InvalidArgument`` here, naming its field
    (``clients.local_checks``); the rest is the worker's to check.
    """
    refs = adapter_refs(adapters)
    check_generate(counts={"width": width, "height": height, "num_inference_steps": steps, "num_images": num_images,
                           "num_frames": num_frames, "fps": fps},
                   seed=seed, scales={"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale},
                   ruled={"cache_threshold": cache_threshold}, strength=strength, adapters=refs,
                   request_id=request_id)
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        negative_prompt=negative_prompt,
        width=width or 0,
        height=height or 0,
        num_inference_steps=steps or 0,
        num_images=num_images or 0,
        output_format=cast("worker_pb2.OutputFormat", output_format_value(output_format)),
        adapters=refs,
        image=image_bytes(image) if image is not None else b"",
        mask_image=image_bytes(mask) if mask is not None else b"",
        task=cast("common_pb2.Task", _named(task, TASKS, "task")),
        resize_mode=cast("worker_pb2.ResizeMode", _named(resize_mode, RESIZE_MODES, "resize mode")),
        num_frames=num_frames or 0,
        fps=fps or 0,
        return_frames=return_frames,
        partial_images=partial_images,
        sampler=sampler,
        controls=control_inputs(controls, image_bytes),
    )
    if ip_adapter is not None:
        request.ip_adapter.CopyFrom(image_prompt(ip_adapter, image_bytes))
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


def build_video_request(
    prompt: str,
    *,
    num_frames: int | None = None,
    fps: int | None = None,
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    seed: int | None = None,
    negative_prompt: str = "",
    image: ImageInput | None = None,
    output_format: str | int = "mp4",
    request_id: str = "",
    return_frames: bool = True,
    resize_mode: str | int = 0,
) -> worker_pb2.GenerateRequest:
    """The GenerateRequest of one video, with its raw frames unless ``return_frames`` is False (which
    saves their transfer when only the container is wanted); None leaves a field to the model's
    default (VideoCapabilities: num_frames on its grid, fps in its range). ``resize_mode`` "resize"
    or "crop" fits an ``image`` of another size than ``width`` x ``height``.

    The task is said, not inferred: text-to-video, or image-to-video from ``image`` (as in
    ``build_generate_request``), so a model that makes images refuses it (INVALID_ARGUMENT naming
    ``task``) instead of answering with an image. ``output_format``: "mp4", "webp" (animated) or "raw".
    """
    return build_generate_request(
        prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
        guidance_scale=guidance_scale, seed=seed, output_format=output_format, request_id=request_id, image=image,
        task=common_pb2.TASK_IMAGE_TO_VIDEO if image is not None else common_pb2.TASK_TEXT_TO_VIDEO,
        resize_mode=resize_mode, num_frames=num_frames, fps=fps, return_frames=return_frames)


def output_format_value(output_format: str | int) -> int:
    if isinstance(output_format, str):
        try:
            return OUTPUT_FORMATS[output_format.lower()]
        except KeyError:
            raise ValueError(f"output_format must be one of {sorted(OUTPUT_FORMATS)}") from None
    return int(output_format)


def build_init_request(model: str, dtype: str | int | None = None,
                       acceleration: common_pb2.Acceleration | Mapping[str, Any] | None = None,
                       parallel: common_pb2.Parallelism | Mapping[str, Any] | None = None,
                       component_overrides: Iterable[common_pb2.ComponentOverride] = (),
                       fused_adapters: Iterable[common_pb2.FusedAdapter] = ()) -> worker_pb2.InitRequest:
    """An InitRequest; ``dtype`` is "float32", "float16", "bfloat16", a ``Dtype`` value or None;
    ``acceleration`` an ``Acceleration`` or its fields (``{"cache": "first_block_cache",
    "cache_threshold": 0.2}``; see docs/acceleration.md); ``parallel`` a ``Parallelism`` or its
    fields (``{"cfg": True, "ulysses_degree": 2}``), for a runner of several devices;
    ``component_overrides`` and ``fused_adapters`` as docs/models.md says (``--component``, ``--fuse-lora``)."""
    if not isinstance(acceleration, common_pb2.Acceleration):
        acceleration = common_pb2.Acceleration(**(acceleration or {}))
    if not isinstance(parallel, common_pb2.Parallelism):
        parallel = common_pb2.Parallelism(**(parallel or {}))
    if dtype is None:
        value: int = common_pb2.DTYPE_UNSPECIFIED
    elif isinstance(dtype, str):
        try:
            value = DTYPES[dtype.lower()]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}") from None
    else:
        value = int(dtype)
    return worker_pb2.InitRequest(model=model, dtype=cast("common_pb2.Dtype", value), acceleration=acceleration,
                                  parallel=parallel, component_overrides=component_overrides,
                                  fused_adapters=fused_adapters)


def adapter_kind(kind: str | int) -> common_pb2.AdapterKind:
    """An AdapterKind by its name ("lora", "controlnet", "ip_adapter") or value."""
    return cast("common_pb2.AdapterKind", _named(kind, KINDS, "adapter kind"))


def build_sleep_request(level: int = 1, tags: Iterable[str] = ()) -> worker_pb2.SleepRequest:
    return worker_pb2.SleepRequest(level=level, tags=list(tags))


def build_wake_request(tags: Iterable[str] = ()) -> worker_pb2.WakeUpRequest:
    return worker_pb2.WakeUpRequest(tags=list(tags))


def health_name(response: health_pb2.HealthCheckResponse) -> str:
    """"SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name
