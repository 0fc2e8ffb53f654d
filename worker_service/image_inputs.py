"""A request's input images: checked, decoded with Pillow and fitted to the requested size.

Its inputs are the image and mask, the conditioning image of each ControlNet (``controls``) and
the IP-Adapter's reference images (``ip_adapter.images``): all follow the same rules, and
``--max-input-bytes`` counts all of them (``encoded_bytes``).

Two passes, so that nothing is decoded for a request that is refused. ``input_sizes`` reads only
the headers: only PNG, JPEG and WebP are opened, and only when within ``--max-size`` on each side
(Pillow's own decompression-bomb limit, ``configure_pillow``, stops a header that claims more).
Once the request is valid and admitted, ``decoded_inputs`` decodes each image, fits the image, mask
and control images to the size (resized or cropped only when the request's ``resize_mode`` says
so; reference images keep their own size) and keeps only those pixels: the full-size decode is
freed and the heap trimmed before it returns.

Both run on a small pool of threads (``DECODE_THREADS``), off the event loop; the pool bounds how
many full-size decodes exist at once, whatever the number of requests. Each reads the image out of
the request message on its thread, when it runs: reading a bytes field copies it, and the message
keeps its own bytes until the call ends (clearing the field frees nothing: protobuf's upb keeps a
message's bytes in its arena), so a copy read before would double what a request waiting for a
thread holds, which ``--max-input-bytes`` counts once.
"""

from __future__ import annotations

import asyncio
import io
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from PIL import Image, ImageOps, UnidentifiedImageError

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.memory import HeapTrimmer
from worker_service.validation import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP")
# Images decoded at once: each holds up to --max-size squared pixels (4 bytes each) while it is.
DECODE_THREADS = 2
_DECODERS = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="image-decode")
_TRIMMER = HeapTrimmer()
# gRPC frees a call's request message a moment after its handler returns, not before.
GIVE_BACK_DELAY_S = 1.0

T = TypeVar("T")


def configure_pillow(max_size: int) -> None:
    """Pillow's decompression-bomb limit at ``max_size`` x ``max_size`` pixels, its warning made an
    error: an image whose header claims more is refused before anything is decoded. Process-wide,
    as Pillow's limit is; called once at start."""
    Image.MAX_IMAGE_PIXELS = max_size * max_size
    warnings.simplefilter("error", Image.DecompressionBombWarning)


Size = tuple[int, int]


@dataclass(frozen=True)
class Input:
    """One input image of a request: its ``field`` (``controls[1].image``), the Pillow ``mode`` it is
    decoded in, how to ``read`` it out of the message (on the decoding thread: each read is a copy)
    and whether it is ``fitted`` to the request's size (a reference image keeps its own)."""

    field: str
    mode: str
    read: Callable[[], bytes]
    fitted: bool = True


def _inputs(request: worker_pb2.GenerateRequest) -> Iterator[Input]:
    """The input images the request sends, in the order the runner takes them."""
    if request.image:  # copies, dropped at once
        yield Input("image", "RGB", lambda: request.image)
    if request.mask_image:
        yield Input("mask_image", "L", lambda: request.mask_image)
    for index, control in enumerate(request.controls):
        if control.image:
            yield Input(f"controls[{index}].image", "RGB", _control_image(control))
    for index in range(len(request.ip_adapter.images)):
        yield Input(f"ip_adapter.images[{index}]", "RGB", _reference_image(request.ip_adapter, index), fitted=False)


def _control_image(control: common_pb2.ControlInput) -> Callable[[], bytes]:
    return lambda: control.image


def _reference_image(prompt: common_pb2.ImagePrompt, index: int) -> Callable[[], bytes]:
    return lambda: prompt.images[index]


def encoded_bytes(request: worker_pb2.GenerateRequest) -> int:
    """The bytes of every input image the request carries, as ``--max-input-bytes`` counts them."""
    return (len(request.image) + len(request.mask_image) + sum(len(control.image) for control in request.controls)
            + sum(len(image) for image in request.ip_adapter.images))


@dataclass(frozen=True)
class InputSizes:
    """The sizes the input headers give: the image and mask (None: not sent), each control image
    sent, each reference image."""

    image: Size | None
    mask: Size | None
    controls: tuple[Size, ...] = ()
    prompts: tuple[Size, ...] = ()


def _grouped(by_field: dict[str, T]) -> tuple[T | None, T | None, tuple[T, ...], tuple[T, ...]]:
    """Values by field (``_each``'s) as the image's, the mask's, the controls' and the references'."""
    return (by_field.get("image"), by_field.get("mask_image"),
            tuple(value for field, value in by_field.items() if field.startswith("controls[")),
            tuple(value for field, value in by_field.items() if field.startswith("ip_adapter.")))


@dataclass(frozen=True)
class DecodedInputs:
    """The request's images as the runner takes them: the image, mask and control images at its
    width x height, the reference images at their own size."""

    image: runner_pb2.RawImage | None
    mask: runner_pb2.RawImage | None
    controls: tuple[runner_pb2.RawImage, ...] = ()
    prompts: tuple[runner_pb2.RawImage, ...] = ()


def _open(data: bytes, field: str, max_size: int) -> Image.Image:
    """The image with only its header read; raises ValidationError naming ``field``."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValidationError([(field, f"claims more pixels than {max_size}x{max_size} (--max-size)")]) from None
    except UnidentifiedImageError:
        raise ValidationError([(field, "is not a PNG, JPEG or WebP image")]) from None
    except (OSError, ValueError, SyntaxError) as error:
        raise _undecodable(field, error) from None
    width, height = image.size
    if width > max_size or height > max_size:
        raise ValidationError([(field, f"is {width}x{height}; at most {max_size} on each side (--max-size)")])
    return image


def _undecodable(field: str, error: Exception) -> ValidationError:
    return ValidationError([(field, f"does not decode: {str(error)[:120]}")])


def _each(request: worker_pb2.GenerateRequest, prefix: str, one: Callable[[bytes, str, Input], T]) -> dict[str, T]:
    """``one(data, field, input)`` for each of the request's inputs sent, by field (in the request's
    order), each read out of the message only for its call; raises one ValidationError naming every
    field that failed."""
    violations: list[tuple[str, str]] = []
    results: dict[str, T] = {}
    for given in _inputs(request):
        try:
            results[given.field] = one(given.read(), prefix + given.field, given)
        except ValidationError as error:
            violations.extend(error.violations)
    if violations:
        raise ValidationError(violations)
    return results


async def _in_pool(function: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_DECODERS, function)


async def input_sizes(request: worker_pb2.GenerateRequest, max_size: int,
                      field_prefix: str = "") -> InputSizes | None:
    """The sizes of the request's input images, from their headers; None when it has none.
    Raises ValidationError naming each field that is not an image or is too large."""
    if next(_inputs(request), None) is None:
        return None
    sizes = await _in_pool(lambda: _each(request, field_prefix,
                                         lambda data, field, _: _open(data, field, max_size).size))
    return InputSizes(*_grouped(sizes))


async def mask_from_alpha(data: bytes, field: str, max_size: int) -> bytes:
    """OpenAI's mask, whose transparent pixels (alpha 0) mark what to repaint, as this worker's: a
    greyscale PNG of 255 - alpha (white: repaint, black: keep, grey between: blended). Raises
    ValidationError naming ``field`` for what ``_open`` refuses, or an image with no alpha channel
    (everything would be kept)."""
    return await _in_pool(lambda: _inverted_alpha(data, field, max_size))


def _inverted_alpha(data: bytes, field: str, max_size: int) -> bytes:
    image = _open(data, field, max_size)
    if not image.has_transparency_data:
        raise ValidationError([(field, "has no alpha channel: its transparent pixels (alpha 0) mark what to repaint")])
    try:
        mask = ImageOps.invert(image.convert("RGBA").getchannel("A"))
    except (OSError, ValueError, SyntaxError) as error:
        raise _undecodable(field, error) from None
    encoded = io.BytesIO()
    mask.save(encoded, "PNG", compress_level=1)
    return encoded.getvalue()


def give_back_memory() -> None:
    """Called on the event loop when a call with image inputs ends: once gRPC has freed its request
    message too, the heap's free pages go back to the OS (on a thread). Without it glibc keeps them
    and the worker's RSS stays at the peak of a burst of large images (2.4 GB after 200 refused
    12.6 MB PNGs, against 120 MB trimmed)."""
    asyncio.get_running_loop().call_later(GIVE_BACK_DELAY_S, _TRIMMER.request)


def fit(image: Image.Image, width: int, height: int, resize_mode: int) -> Image.Image:
    """The image at ``width`` x ``height``: scaled (RESIZE), scaled to cover and center-cropped
    (CROP), or as it is (the caller checked its size already)."""
    if image.size == (width, height):
        return image
    if resize_mode == worker_pb2.RESIZE_MODE_CROP:
        return ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS)
    return image.resize((width, height), Image.Resampling.LANCZOS)


def raw(image: Image.Image) -> runner_pb2.RawImage:
    """The pixels the runner takes: height x width x channels bytes."""
    return runner_pb2.RawImage(pixels=image.tobytes(), width=image.width, height=image.height,
                               channels=len(image.getbands()))


def _decode_fitted(data: bytes, field: str, mode: str, max_size: int, size: Size | None, resize_mode: int,
                   draft: bool) -> runner_pb2.RawImage:
    """One image decoded in ``mode`` and fitted to ``size`` (None: kept at its own); only the fitted
    pixels outlive the call. With ``draft``, a JPEG larger than ``size`` is decoded at the smallest
    scale (1/2 to 1/8) that still covers it."""
    image = _open(data, field, max_size)
    if size is None:
        size, draft = image.size, False
    try:
        if draft:
            image.draft(mode, size)
        image.load()
    except (OSError, ValueError, SyntaxError) as error:
        raise _undecodable(field, error) from None
    if image.mode != mode:
        image = image.convert(mode)
    return raw(fit(image, *size, resize_mode))


def _decoded(request: worker_pb2.GenerateRequest, max_size: int, size: Size, resize_mode: int,
             field_prefix: str) -> dict[str, runner_pb2.RawImage]:
    # A mask is fitted exactly as its image is, so it stays over the same pixels: no drafts then.
    fitting = resize_mode != worker_pb2.RESIZE_MODE_UNSPECIFIED
    masked = bool(request.mask_image)
    try:
        return _each(request, field_prefix, lambda data, field, given: _decode_fitted(
            data, field, given.mode, max_size, size if given.fitted else None, resize_mode,
            fitting and not (masked and given.field in ("image", "mask_image"))))
    finally:
        _TRIMMER.request()  # the full-size decodes are garbage now: their pages go back to the OS


async def decoded_inputs(request: worker_pb2.GenerateRequest, max_size: int, size: Size,
                         field_prefix: str = "") -> DecodedInputs:
    """The request's input images decoded, the image, mask and control images fitted to ``size`` (as
    its ``resize_mode`` says), as the runner takes them. Raises ValidationError naming each field
    whose data does not decode."""
    decoded = await _in_pool(lambda: _decoded(request, max_size, size, request.resize_mode, field_prefix))
    return DecodedInputs(*_grouped(decoded))
