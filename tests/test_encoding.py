"""The worker's image encoding: lossless formats give the exact pixels back on every encoder path,
and a request's images, encoded in parallel threads, come back in order."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from diffusion.v1 import runner_pb2
from diffusion.v1 import worker_pb2 as W
from worker_service.encoding import MIME_TYPES, encode_image, encode_images
from worker_service.pixel_encoders import FASTEST, PILLOW, PixelEncoder

pytestmark = pytest.mark.unit

ENCODER_SETS = {"fastest": FASTEST, "pillow": PILLOW}
LOSSLESS = {"png": W.OUTPUT_FORMAT_PNG, "unspecified": W.OUTPUT_FORMAT_UNSPECIFIED, "webp": W.OUTPUT_FORMAT_WEBP}


def pixels(height: int, width: int, channels: int, seed: int) -> np.ndarray:
    """Gradients and noise (every value 0-255 occurs), odd sizes: what a lossless encoder must keep."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = (x * 7 + y * 3 + seed)[..., None] + np.arange(channels) * 50
    image = (smooth + rng.integers(-3, 4, (height, width, channels))) % 256
    return image.astype(np.uint8).reshape((height, width) if channels == 1 else (height, width, channels))


def raw_image(image: np.ndarray) -> runner_pb2.RawImage:
    channels = 1 if image.ndim == 2 else image.shape[2]
    return runner_pb2.RawImage(pixels=image.tobytes(), width=image.shape[1], height=image.shape[0],
                               channels=channels)


def decoded(data: bytes, channels: int) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("L" if channels == 1 else "RGB"))


def test_the_fastest_png_encoder_is_not_pillow() -> None:
    """imagecodecs is a dependency: the worker's PNG path is the measured faster one."""
    assert FASTEST[W.OUTPUT_FORMAT_PNG] is not PILLOW[W.OUTPUT_FORMAT_PNG]


@pytest.mark.parametrize("encoders", ENCODER_SETS.values(), ids=ENCODER_SETS.keys())
@pytest.mark.parametrize("output_format", LOSSLESS.values(), ids=LOSSLESS.keys())
@pytest.mark.parametrize("channels", [3, 1])
def test_lossless_formats_decode_to_the_exact_pixels(encoders: dict[int, PixelEncoder], output_format: int,
                                                     channels: int) -> None:
    for height, width in ((1, 1), (37, 53), (256, 192)):
        image = pixels(height, width, channels, seed=height)
        data = encode_image(raw_image(image), output_format, encoders)
        expected_format = "WEBP" if output_format == W.OUTPUT_FORMAT_WEBP else "PNG"
        assert Image.open(io.BytesIO(data)).format == expected_format
        np.testing.assert_array_equal(decoded(data, channels), image)


@pytest.mark.parametrize("encoders", ENCODER_SETS.values(), ids=ENCODER_SETS.keys())
def test_jpeg_is_a_jpeg_of_the_image(encoders: dict[int, PixelEncoder]) -> None:
    image = np.zeros((48, 64, 3), np.uint8)
    image[:, 32:] = (200, 40, 90)  # the edge on a 16-pixel block boundary: no ringing
    data = encode_image(raw_image(image), W.OUTPUT_FORMAT_JPEG, encoders)
    with Image.open(io.BytesIO(data)) as jpeg:
        assert (jpeg.format, jpeg.size) == ("JPEG", (64, 48))
    error = np.abs(decoded(data, 3).astype(int) - image)
    assert error[:, :28].max() <= 2 and error[:, 36:].max() <= 2  # quality 95; chroma upsampling blurs the edge


def test_raw_is_passed_through_and_a_wrong_length_is_refused() -> None:
    raw = raw_image(pixels(5, 7, 3, seed=1))
    assert encode_image(raw, W.OUTPUT_FORMAT_RAW) == raw.pixels
    raw.pixels = raw.pixels[:-1]
    with pytest.raises(ValueError, match="104 bytes for a 7x5x3 image"):
        encode_image(raw, W.OUTPUT_FORMAT_PNG)


@pytest.mark.parametrize("output_format", [W.OUTPUT_FORMAT_PNG, W.OUTPUT_FORMAT_WEBP, W.OUTPUT_FORMAT_RAW])
def test_a_batch_encoded_in_parallel_comes_back_in_order(output_format: int) -> None:
    """More images than the pool has threads, of different sizes so they finish out of order."""
    images = [pixels(16 + 40 * (i % 3), 24 + 8 * i, 3, seed=i) for i in range(12)]
    seeds = [1000 + i for i in range(12)]
    results = asyncio.run(encode_images([raw_image(image) for image in images], output_format, seeds))
    assert [r.seed for r in results] == seeds
    for image, result in zip(images, results, strict=True):
        assert (result.mime_type, result.width, result.height) == (MIME_TYPES[output_format], image.shape[1],
                                                                    image.shape[0])
        if output_format == W.OUTPUT_FORMAT_RAW:
            assert result.data == image.tobytes()
        else:
            np.testing.assert_array_equal(decoded(result.data, 3), image)
