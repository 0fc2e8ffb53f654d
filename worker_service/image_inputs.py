"""A request's input image and mask: decoded with Pillow, checked, fitted to the requested size.

Only PNG, JPEG and WebP are opened, and only after their header says the image is within
``--max-size`` on each side; Pillow's own decompression-bomb limit (``configure_pillow``) stops a
header that claims more before any decoding. Images are resized or cropped only when the
request's ``resize_mode`` says so. Decoding and fitting run in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from diffusion.v1 import runner_pb2, worker_pb2
from worker_service.validation import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP")


def configure_pillow(max_size: int) -> None:
    """Pillow's decompression-bomb limit at ``max_size`` x ``max_size`` pixels, its warning made an
    error: an image whose header claims more is refused before anything is decoded. Process-wide,
    as Pillow's limit is; called once at start."""
    Image.MAX_IMAGE_PIXELS = max_size * max_size
    warnings.simplefilter("error", Image.DecompressionBombWarning)


@dataclass(frozen=True)
class OpenedInputs:
    """The decoded image ("RGB") and mask ("L"), at the sizes they came in."""

    image: Image.Image | None
    mask: Image.Image | None

    @property
    def size(self) -> tuple[int, int] | None:
        return self.image.size if self.image is not None else None

    @property
    def mask_size(self) -> tuple[int, int] | None:
        return self.mask.size if self.mask is not None else None


def _open(data: bytes, field: str, mode: str, max_size: int) -> Image.Image:
    """One image decoded and converted to ``mode``; raises ValidationError naming ``field``."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width > max_size or height > max_size:
            raise ValidationError([(field, f"is {width}x{height}; at most {max_size} on each side (--max-size)")])
        image.load()
    except ValidationError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValidationError([(field, f"claims more pixels than {max_size}x{max_size} (--max-size)")]) from None
    except UnidentifiedImageError:
        raise ValidationError([(field, "is not a PNG, JPEG or WebP image")]) from None
    except (OSError, ValueError, SyntaxError) as error:
        raise ValidationError([(field, f"does not decode: {str(error)[:120]}")]) from None
    return image.convert(mode)


def _open_inputs(request: worker_pb2.GenerateRequest, max_size: int, field_prefix: str = "") -> OpenedInputs:
    """The request's image and mask decoded; every field that does not decode is named."""
    violations: list[tuple[str, str]] = []
    opened: dict[str, Image.Image | None] = {"image": None, "mask_image": None}
    for field, mode in (("image", "RGB"), ("mask_image", "L")):
        data = getattr(request, field)
        if not data:
            continue
        try:
            opened[field] = _open(data, field_prefix + field, mode, max_size)
        except ValidationError as error:
            violations.extend(error.violations)
    if violations:
        raise ValidationError(violations)
    return OpenedInputs(opened["image"], opened["mask_image"])


async def open_inputs(request: worker_pb2.GenerateRequest, max_size: int,
                      field_prefix: str = "") -> OpenedInputs | None:
    """The request's image and mask decoded in a thread; None when it has neither. Raises
    ValidationError naming each field that does not decode or is too large."""
    if not request.image and not request.mask_image:
        return None
    return await asyncio.to_thread(_open_inputs, request, max_size, field_prefix)


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


def _fitted(opened: OpenedInputs, width: int, height: int,
            resize_mode: int) -> tuple[runner_pb2.RawImage | None, runner_pb2.RawImage | None]:
    # The mask is fitted the same way as the image, so it stays over the same pixels.
    image, mask = ((None if each is None else raw(fit(each, width, height, resize_mode)))
                   for each in (opened.image, opened.mask))
    return image, mask


async def fitted_inputs(opened: OpenedInputs, width: int, height: int,
                        resize_mode: int) -> tuple[runner_pb2.RawImage | None, runner_pb2.RawImage | None]:
    """The image and mask at the request's size, as the runner takes them, fitted in a thread."""
    return await asyncio.to_thread(_fitted, opened, width, height, resize_mode)
