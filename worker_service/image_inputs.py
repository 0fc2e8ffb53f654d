"""A request's input image and mask: checked, decoded with Pillow and fitted to the requested size.

Two passes, so that nothing is decoded for a request that is refused. ``input_sizes`` reads only
the headers: only PNG, JPEG and WebP are opened, and only when within ``--max-size`` on each side
(Pillow's own decompression-bomb limit, ``configure_pillow``, stops a header that claims more).
Once the request is valid and admitted, ``decoded_inputs`` decodes each image, fits it to the size
(resized or cropped only when the request's ``resize_mode`` says so) and keeps only the fitted
pixels: the full-size decode is freed and the heap trimmed before it returns.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from PIL import Image, ImageOps, UnidentifiedImageError

from diffusion.v1 import runner_pb2, worker_pb2
from serving_common.memory import HeapTrimmer
from worker_service.validation import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP")
# Images decoded at once: each holds up to --max-size squared pixels (4 bytes each) while it is.
DECODE_THREADS = 2
_DECODERS = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="image-decode")
_FIELDS = (("image", "RGB"), ("mask_image", "L"))
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


@dataclass(frozen=True)
class InputSizes:
    """The sizes the image and mask headers give (None: not sent)."""

    image: tuple[int, int] | None
    mask: tuple[int, int] | None


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


def _each(request: worker_pb2.GenerateRequest, prefix: str, one: Callable[[bytes, str, str], T]) -> dict[str, T]:
    """``one(data, field, mode)`` for each of the request's inputs sent, by field, each read out of
    the message only for its call; raises one ValidationError naming every field that failed."""
    violations: list[tuple[str, str]] = []
    results: dict[str, T] = {}
    for field, mode in _FIELDS:
        data = getattr(request, field)
        if not data:
            continue
        try:
            results[field] = one(data, prefix + field, mode)
        except ValidationError as error:
            violations.extend(error.violations)
    if violations:
        raise ValidationError(violations)
    return results


async def _in_pool(function: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_DECODERS, function)


async def input_sizes(request: worker_pb2.GenerateRequest, max_size: int,
                      field_prefix: str = "") -> InputSizes | None:
    """The sizes of the request's image and mask, from their headers; None when it has neither.
    Raises ValidationError naming each field that is not an image or is too large."""
    if not request.image and not request.mask_image:  # copies, dropped at once
        return None
    sizes = await _in_pool(lambda: _each(request, field_prefix,
                                         lambda data, field, _: _open(data, field, max_size).size))
    return InputSizes(sizes.get("image"), sizes.get("mask_image"))


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


def _decode_fitted(data: bytes, field: str, mode: str, max_size: int, size: tuple[int, int], resize_mode: int,
                   draft: bool) -> runner_pb2.RawImage:
    """One image decoded in ``mode`` and fitted to ``size``; only the fitted pixels outlive the call.
    With ``draft``, a JPEG larger than ``size`` is decoded at the smallest scale (1/2 to 1/8) that
    still covers it."""
    image = _open(data, field, max_size)
    try:
        if draft:
            image.draft(mode, size)
        image.load()
    except (OSError, ValueError, SyntaxError) as error:
        raise _undecodable(field, error) from None
    if image.mode != mode:
        image = image.convert(mode)
    return raw(fit(image, *size, resize_mode))


def _decoded(request: worker_pb2.GenerateRequest, max_size: int, size: tuple[int, int], resize_mode: int,
             field_prefix: str) -> dict[str, runner_pb2.RawImage]:
    # A mask is fitted exactly as its image is, so it stays over the same pixels: no drafts then.
    draft = not request.mask_image and resize_mode != worker_pb2.RESIZE_MODE_UNSPECIFIED
    try:
        return _each(request, field_prefix, lambda data, field, mode: _decode_fitted(
            data, field, mode, max_size, size, resize_mode, draft))
    finally:
        _TRIMMER.request()  # the full-size decodes are garbage now: their pages go back to the OS


async def decoded_inputs(request: worker_pb2.GenerateRequest, max_size: int, size: tuple[int, int],
                         field_prefix: str = "") -> tuple[runner_pb2.RawImage | None, runner_pb2.RawImage | None]:
    """The request's image and mask decoded and fitted to ``size`` (as its ``resize_mode`` says), as
    the runner takes them. Raises ValidationError naming each field whose data does not decode."""
    fitted = await _in_pool(lambda: _decoded(request, max_size, size, request.resize_mode, field_prefix))
    return fitted.get("image"), fitted.get("mask_image")
