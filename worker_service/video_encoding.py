"""Video encoding of a request's frames: H.264 in MP4 (PyAV), animated lossless WebP (Pillow), or
the raw frames passed through.

The frames arrive as one buffer of num_frames x height x width x 3 bytes (the dispatcher's, filled
from the runner's ExecuteFrames) and are encoded from it in memory, no file written. Encoding runs
on a thread off the event loop; ``encode_video`` yields ENCODING progress (frames done of all) as
it goes, then the bytes, so that a long video's client sees it move.
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator, Callable
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

from diffusion.v1 import common_pb2, worker_pb2

MIME_TYPES: dict[int, str] = {
    worker_pb2.OUTPUT_FORMAT_MP4: "video/mp4",
    worker_pb2.OUTPUT_FORMAT_WEBP: "image/webp",
    worker_pb2.OUTPUT_FORMAT_RAW: "application/octet-stream",
}

# libx264's constant rate factor: 18 is about visually lossless for generated frames, at a few
# times the size of the default 23; these files are small beside the frames (tens of KiB a second).
MP4_CRF = 18
# libwebp's effort at lossless (method 1, quality 0), as for still WebP (pixel_encoders.py).
WEBP_METHOD = 1

OnFrames = Callable[[int], None]  # frames encoded so far


class EncodingStopped(Exception):
    """The request's call ended while its video was encoding: the rest is not encoded."""


def frames_array(frames: bytes | bytearray | memoryview, num_frames: int, width: int, height: int) -> np.ndarray:
    """The frames as a (num_frames, height, width, 3) uint8 view of ``frames`` (no copy)."""
    return np.frombuffer(frames, np.uint8).reshape(num_frames, height, width, 3)


def encode_mp4(frames: np.ndarray, fps: int, on_frames: OnFrames, stop: threading.Event) -> bytes:
    """H.264 (libx264, yuv420p, CRF ``MP4_CRF``) in MP4 at ``fps``: width and height must be even.

    Do not rely on the same bytes for the same frames: once, under load, libx264 (PyAV 18's) chose
    between two encodings of the same 32x32 frames from run to run (2244 or 2272 bytes); 60
    encodes each of random and smooth frames gave one encoding later. The frames (RAW,
    return_frames) are the same per seed."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(MP4_CRF)}
        for index, pixels in enumerate(frames):
            if stop.is_set():
                raise EncodingStopped
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
            on_frames(index + 1)
        container.mux(stream.encode(None))
    return buffer.getvalue()


def encode_webp(frames: np.ndarray, fps: int, on_frames: OnFrames, stop: threading.Event) -> bytes:
    """An animated lossless WebP, each frame shown 1/fps s, looping. Pillow encodes all the frames in
    one call: progress comes once, at its end."""
    images = [Image.fromarray(pixels) for pixels in frames]  # views of the buffer, no copies
    buffer = io.BytesIO()
    images[0].save(buffer, "WEBP", save_all=True, append_images=images[1:], duration=1000 / fps, loop=0,
                   lossless=True, method=WEBP_METHOD, quality=0)
    on_frames(len(images))
    return buffer.getvalue()


def encode_raw(frames: np.ndarray, fps: int, on_frames: OnFrames, stop: threading.Event) -> bytes:
    """The frames as they are."""
    on_frames(len(frames))
    return frames.tobytes()


ENCODERS: dict[int, Callable[[np.ndarray, int, OnFrames, threading.Event], bytes]] = {
    worker_pb2.OUTPUT_FORMAT_MP4: encode_mp4,
    worker_pb2.OUTPUT_FORMAT_WEBP: encode_webp,
    worker_pb2.OUTPUT_FORMAT_RAW: encode_raw,
}


async def encode_video(frames: np.ndarray, output_format: int,
                       fps: int) -> AsyncIterator[worker_pb2.ProgressEvent | bytes]:
    """ENCODING progress events (frames encoded of all), then the encoded bytes, encoding on a thread.
    Closing the iterator early stops the encoder at its next frame."""
    loop = asyncio.get_running_loop()
    total = len(frames)
    events: asyncio.Queue[worker_pb2.ProgressEvent] = asyncio.Queue()
    stop = threading.Event()

    def on_frames(done: int) -> None:
        loop.call_soon_threadsafe(events.put_nowait, worker_pb2.ProgressEvent(
            step=done, total_steps=total, phase=common_pb2.PROGRESS_PHASE_ENCODING))

    encoder = ENCODERS[output_format]
    encoding = loop.run_in_executor(None, encoder, frames, fps, on_frames, stop)
    try:
        while not encoding.done():
            getter = asyncio.ensure_future(events.get())
            either: set[asyncio.Future[Any]] = {encoding, getter}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
        data = await encoding
        while not events.empty():  # the thread's last calls land before its result is seen
            yield events.get_nowait()
        yield data
    finally:
        stop.set()  # and its EncodingStopped, when the iterator was closed early, is not an error to log
        encoding.add_done_callback(lambda done: done.cancelled() or done.exception())
