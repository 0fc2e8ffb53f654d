"""The worker's video encoders (``worker_service/video_encoding.py``): what they write decodes back
with the field's libraries (PyAV for MP4, Pillow for WebP) to the frames given."""

from __future__ import annotations

import asyncio
import io

import av
import numpy as np
import pytest
from PIL import Image

from diffusion.v1 import common_pb2, worker_pb2
from worker_service.video_encoding import encode_video

pytestmark = pytest.mark.unit

FRAMES, HEIGHT, WIDTH, FPS = 9, 32, 48, 12


def moving_gradient() -> np.ndarray:
    """Smooth frames that change from one to the next, as a generated video's do."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    return np.stack([np.stack([(x * 4 + t * 10) % 256, (y * 6 + t * 5) % 256, np.full_like(x, 40 + t * 20)],
                              axis=-1) for t in range(FRAMES)]).astype(np.uint8)


def encoded(frames: np.ndarray, output_format: int) -> tuple[bytes, list[worker_pb2.ProgressEvent]]:
    async def main() -> tuple[bytes, list[worker_pb2.ProgressEvent]]:
        events, data = [], b""
        async for item in encode_video(frames, output_format, FPS):
            if isinstance(item, bytes):
                data = item
            else:
                events.append(item)
        return data, events
    return asyncio.run(main())


def test_mp4_decodes_back_to_the_frames_count_size_and_rate_with_encoding_progress_per_frame() -> None:
    frames = moving_gradient()
    data, events = encoded(frames, worker_pb2.OUTPUT_FORMAT_MP4)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.average_rate == FPS
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    assert decoded.shape == frames.shape
    # yuv420p halves the chroma's resolution: close, not equal.
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 4
    assert [(e.step, e.total_steps) for e in events] == [(i, FRAMES) for i in range(1, FRAMES + 1)]
    assert {e.phase for e in events} == {common_pb2.PROGRESS_PHASE_ENCODING}


def test_webp_is_animated_lossless_at_the_frame_rate() -> None:
    frames = moving_gradient()
    data, events = encoded(frames, worker_pb2.OUTPUT_FORMAT_WEBP)
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "WEBP" and image.n_frames == FRAMES
        for index in range(FRAMES):
            image.seek(index)
            assert np.array_equal(np.asarray(image.convert("RGB")), frames[index])
            # WebP keeps whole milliseconds of timestamps: each frame shows 1000/fps ms, rounded.
            assert abs(image.info["duration"] - 1000 / FPS) <= 1
    assert (events[-1].step, events[-1].total_steps) == (FRAMES, FRAMES)


def test_raw_is_the_frames_as_they_are() -> None:
    frames = moving_gradient()
    data, events = encoded(frames, worker_pb2.OUTPUT_FORMAT_RAW)
    assert data == frames.tobytes()
    assert (events[-1].step, events[-1].total_steps) == (FRAMES, FRAMES)
