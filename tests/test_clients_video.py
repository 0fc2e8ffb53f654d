"""The clients' and the CLI's videos against a real runner serving the built-in ``tiny-wan`` and a real
worker on it: ``generate_video`` over GenerateStream (chunks put together, frames beside the
container), the asyncio client, ``diffusion generate-video``; and the chunk assembly's bounds."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Iterator
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from clients import AsyncDiffusionClient, DiffusionClient, InvalidArgument, VideoResult
from clients.errors import DiffusionError
from clients.types import Chunk, Done, StreamReader
from diffusion.v1 import worker_pb2
from support import Pair, cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

# The smallest video worth the name on tiny-wan: 5 frames (4k+1) of 32x32, 2 steps.
VIDEO = {"num_frames": 5, "fps": 8, "width": 32, "height": 32, "steps": 2, "seed": 3}
PROMPT = "a fox running in the snow"


@pytest.fixture(scope="module")
def pair(serve: Callable[..., Pair]) -> Pair:
    """A runner and a worker serving tiny-wan (text-to-video), for this module."""
    return serve("--model", "tiny-wan")


@pytest.fixture(scope="module")
def client(pair: Pair) -> Iterator[DiffusionClient]:
    with DiffusionClient(pair.worker.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def mp4(client: DiffusionClient) -> VideoResult:
    """The MP4 of VIDEO, with its frames."""
    return client.generate_video(PROMPT, **VIDEO)


def decoded(data: bytes) -> tuple[list[np.ndarray], Fraction]:
    """A container's frames (RGB arrays) and its stream's frame rate, decoded with PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        rate = Fraction(stream.average_rate)
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)], rate


# --- the library ------------------------------------------------------------------------------------

def test_generate_video_gives_the_frames_asked_for_beside_the_mp4(mp4):
    assert mp4.frames is not None and mp4.frames.dtype == np.uint8
    assert mp4.frames.shape == (5, 32, 32, 3)
    assert (mp4.num_frames, mp4.width, mp4.height, mp4.fps, mp4.seed) == (5, 32, 32, 8, 3)
    assert mp4.mime_type == "video/mp4" and mp4.extension == ".mp4" and mp4.request_id
    assert mp4.frames.std() > 0, "the frames hold a picture, not a constant"


def test_the_frames_equal_the_raw_output_of_the_same_seed(client, mp4):
    raw = client.generate_video(PROMPT, output_format="raw", **VIDEO)
    assert raw.extension == ".raw" and raw.frames is not None
    assert raw.data == mp4.frames.tobytes()
    np.testing.assert_array_equal(raw.frames, mp4.frames)


def test_the_mp4_decodes_to_the_frame_count_size_and_fps(mp4):
    frames, rate = decoded(mp4.data)
    assert len(frames) == 5 and rate == 8
    assert all(frame.shape == (32, 32, 3) for frame in frames)
    # H.264 in yuv420p is lossy: the decoded frames are near the raw ones (2.7 levels off on average), not equal.
    error = np.abs(np.stack(frames).astype(int) - mp4.frames.astype(int)).mean()
    assert error < 8, error


def test_an_animated_webp_has_every_frame(client, mp4):
    webp = client.generate_video(PROMPT, output_format="webp", **VIDEO)
    assert webp.mime_type == "image/webp" and webp.extension == ".webp"
    with Image.open(io.BytesIO(webp.data)) as image:
        assert image.n_frames == 5 and image.size == (32, 32)
        image.seek(4)
        last = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(last, mp4.frames[4])  # lossless


def test_progress_goes_through_denoising_decoding_and_encoding_in_order(client):
    seen: list[tuple[str, int, int]] = []
    client.generate_video(PROMPT, on_progress=lambda *event: seen.append(event), **VIDEO)
    phases = [phase for phase, _, _ in seen]
    order = list(dict.fromkeys(phases))
    assert order == ["denoising", "decoding", "encoding"], seen
    assert phases == sorted(phases, key=order.index), f"a phase came back after the next began: {seen}"
    assert [(step, total) for phase, step, total in seen if phase == "denoising"] == [(1, 2), (2, 2)]
    for phase in ("decoding", "encoding"):
        steps = [(step, total) for name, step, total in seen if name == phase]
        assert steps[-1][0] == steps[-1][1] and [s for s, _ in steps] == sorted(s for s, _ in steps), seen


def test_the_stream_yields_chunks_and_a_done_with_the_whole_video(client, mp4):
    with client.stream_video(PROMPT, **VIDEO) as stream:
        events = list(stream)
    chunks = [event for event in events if isinstance(event, Chunk)]
    assert {chunk.frames for chunk in chunks} == {False, True}
    assert isinstance(events[-1], Done)
    video = events[-1].result.video()
    assert {len(video.data), video.frames.nbytes} == {chunk.total_bytes for chunk in chunks}
    np.testing.assert_array_equal(video.frames, mp4.frames)
    assert len(decoded(video.data)[0]) == 5


def test_the_asyncio_client_gives_the_same_frames(pair, mp4):
    async def generate() -> VideoResult:
        async with AsyncDiffusionClient(pair.worker.target, timeout=120) as client:
            return await client.generate_video(PROMPT, **VIDEO)

    video = asyncio.run(generate())
    assert video.frames is not None
    np.testing.assert_array_equal(video.frames, mp4.frames)
    assert video.mime_type == "video/mp4" and len(decoded(video.data)[0]) == 5  # MP4s hold their creation time


def test_a_frame_count_off_the_grid_is_invalid_argument_naming_num_frames(client):
    with pytest.raises(InvalidArgument) as caught:
        client.generate_video(PROMPT, **{**VIDEO, "num_frames": 4})
    assert any(field.endswith("num_frames") for field in caught.value.violations), caught.value.violations


def test_an_image_on_a_text_to_video_model_is_refused_not_ignored(client, mp4):
    with pytest.raises(InvalidArgument) as caught:
        client.generate_video(PROMPT, image=mp4.frames[0], **VIDEO)
    assert any(field.endswith(("task", "image")) for field in caught.value.violations), caught.value.violations


# --- the CLI ----------------------------------------------------------------------------------------

def test_the_cli_writes_an_mp4_that_decodes_back(pair, tmp_path):
    out = tmp_path / "fox.mp4"
    done = cli("--target", pair.worker.target, "generate-video", PROMPT, "-o", str(out), "--frames", "5",
               "--fps", "8", "--size", "32x32", "--steps", "2", "--seed", "3")
    assert done.returncode == 0, done.stderr
    frames, rate = decoded(out.read_bytes())
    assert len(frames) == 5 and rate == 8 and frames[0].shape == (32, 32, 3)
    assert f"wrote {out} (5 frames of 32x32 at 8 fps, seed 3)" in done.stdout
    bars = [line.split(" [")[0] for line in done.stderr.splitlines() if " [" in line]
    assert list(dict.fromkeys(bars)) == ["denoising", "decoding", "encoding"], done.stderr


def test_the_cli_reports_a_bad_frame_count_by_its_field(pair, tmp_path):
    done = cli("--target", pair.worker.target, "generate-video", PROMPT, "-o", str(tmp_path / "x.mp4"),
               "--frames", "4", "--size", "32x32", "--steps", "2")
    assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr and "num_frames" in done.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_the_cli_refuses_an_extension_that_names_no_video_format(tmp_path):
    done = cli("generate-video", PROMPT, "-o", str(tmp_path / "fox.png"))
    assert done.returncode == 2 and ".png names no video format" in done.stderr


# --- the chunk assembly (no server: the worker's side is what the tests above use) ------------------

def _chunk(offset: int, data: bytes, total: int, frames: bool = False) -> worker_pb2.GenerateStreamResponse:
    return worker_pb2.GenerateStreamResponse(chunk=worker_pb2.ResultChunk(
        video_index=0, frames=frames, offset=offset, data=data, total_bytes=total))


def _done(*videos: worker_pb2.Video) -> worker_pb2.GenerateStreamResponse:
    return worker_pb2.GenerateStreamResponse(done=worker_pb2.GenerateResponse(request_id="r", videos=videos))


MP4_VIDEO = worker_pb2.Video(mime_type="video/mp4", width=2, height=2, num_frames=1, fps=8)


@pytest.mark.parametrize("second", [
    pytest.param(_chunk(4, b"xy", 6), id="a gap"),
    pytest.param(_chunk(2, b"xy", 6), id="an overlap"),
    pytest.param(_chunk(3, b"xy", 8), id="another total"),
    pytest.param(_chunk(3, b"xyzw", 6), id="past the total"),
])
def test_a_chunk_out_of_line_is_refused_before_it_is_kept(second):
    reader = StreamReader()
    reader.event(_chunk(0, b"abc", 6))
    with pytest.raises(DiffusionError, match="does not follow") as caught:
        reader.event(second)
    assert caught.value.code().name == "DATA_LOSS"


def test_a_result_whose_chunks_stopped_short_is_refused():
    reader = StreamReader()
    reader.event(_chunk(0, b"abc", 6))
    with pytest.raises(DiffusionError, match="ended at 3 of 6 bytes"):
        reader.event(_done(MP4_VIDEO))


def test_frames_that_disagree_with_the_size_are_refused():
    reader = StreamReader()
    reader.event(_chunk(0, b"abc", 3))
    reader.event(_chunk(0, bytes(11), 11, frames=True))  # 2x2x3 is 12
    with pytest.raises(DiffusionError, match="11 bytes of frames"):
        reader.event(_done(MP4_VIDEO))


def test_chunks_in_line_make_the_video():
    reader = StreamReader()
    pixels = bytes(range(12))
    for response in (_chunk(0, b"abc", 5), _chunk(3, b"de", 5), _chunk(0, pixels, 12, frames=True)):
        reader.event(response)
    done = reader.event(_done(MP4_VIDEO))
    assert isinstance(done, Done)
    video = done.result.video()
    assert video.data == b"abcde" and video.frames is not None
    assert video.frames.tobytes() == pixels and video.frames.shape == (1, 2, 2, 3)
