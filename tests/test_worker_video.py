"""Video generation through the worker (issue 26): validation, dispatch of a video alone on its
runner, frames assembled from ExecuteFrames, MP4/WebP/RAW results, GenerateStream's chunks and
Generate's message limit.

Most tests run the real worker process against two in-process fake runners in video mode
(``tests/fake_runner.py``, served from a thread of this process so that a test holds a video
mid-run with a gate); the last ones run a real runner serving ``tiny-wan``.
"""

from __future__ import annotations

import asyncio
import io
import signal
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import av
import grpc
import numpy as np
import pytest
from PIL import Image

from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from fake_runner import VIDEO as VIDEO_CAPS
from fake_runner import FakeRunner, serve_fake_runner
from harness.processes import free_port, start_worker, wait_until
from harness.streams import Stream
from support import running_pair, start_pair
from worker_service.config import Limits
from worker_service.scheduling.batching import BatchPolicy, select_batch
from worker_service.scheduling.budget import load
from worker_service.scheduling.jobs import Job
from worker_service.validation import normalize

pytestmark = pytest.mark.process

W = worker_pb2
T = TypeVar("T")
# Small enough that 9 raw 64x64 frames (110592 bytes) do not fit a unary response; 5 do.
MAX_MESSAGE_BYTES = 100_000
CHUNK_BYTES = 4096
VIDEO: dict[str, Any] = dict(task=common_pb2.TASK_TEXT_TO_VIDEO, width=32, height=32, num_inference_steps=2, seed=7)


def video_request(**fields: Any) -> worker_pb2.GenerateRequest:
    """A 32x32 video request of seed 7 in 2 steps, with ``fields``."""
    return W.GenerateRequest(**{**VIDEO, **fields})


class FakeRunners:
    """Fake video runners served by an event loop on a thread of the test process."""

    def __init__(self, directory: Path, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes = [FakeRunner(video=True) for _ in range(count)]
        self.targets = [f"unix:{directory}/video-runner-{i}.sock" for i in range(count)]
        self.servers = [self.call(serve_fake_runner(fake, target)) for fake, target in zip(self.fakes, self.targets,
                                                                                            strict=True)]

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def hold_videos(self) -> None:
        gate = asyncio.Event()
        for fake in self.fakes:
            fake.video_open = gate

    def release_videos(self) -> None:
        for fake in self.fakes:
            if fake.video_open is not None:
                self.loop.call_soon_threadsafe(fake.video_open.set)

    def close(self) -> None:
        for server in self.servers:
            self.call(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeRunners]:
    runners = FakeRunners(tmp_path_factory.mktemp("video-fakes"), 2)
    yield runners
    runners.close()


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def stub(fakes: FakeRunners, tmp_path_factory: pytest.TempPathFactory) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    worker = start_worker(tmp_path_factory.mktemp("video-worker"), fakes.targets[0], "--runner", fakes.targets[1],
                          "--model", "fake-video", "--max-size", "64", "--max-images", "1",
                          "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--stream-chunk-bytes", str(CHUNK_BYTES),
                          "--max-batch-delay-ms", "0", "--metrics-port", str(METRICS_PORT))
    with grpc.insecure_channel(worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        wait_until(lambda: sum(r.ready for r in stub.GetStatus(W.GetStatusRequest(), timeout=5).runners) == 2, 30,
                   "both runners ready")
        yield stub
    worker.stop()


Chunks = dict[tuple[int, bool], bytes]  # reassembled data (False) and frames (True) by video index


def streamed(stub: worker_pb2_grpc.WorkerServiceStub, request: worker_pb2.GenerateRequest,
             ) -> tuple[list[worker_pb2.GenerateStreamResponse], worker_pb2.GenerateResponse, Chunks]:
    """Every event of a GenerateStream, its done response, and its chunks reassembled by (video, frames)."""
    events = list(stub.GenerateStream(W.GenerateStreamRequest(request=request), timeout=60))
    assembled: dict[tuple[int, bool], bytearray] = {}
    for event in events:
        if event.HasField("chunk"):
            chunk = event.chunk
            assert 0 < len(chunk.data) <= CHUNK_BYTES
            into = assembled.setdefault((chunk.video_index, chunk.frames), bytearray())
            assert chunk.offset == len(into)  # in order, at increasing offsets
            into += chunk.data
            assert len(into) <= chunk.total_bytes
    assert events[-1].HasField("done")
    return events, events[-1].done, {key: bytes(data) for key, data in assembled.items()}


def flat_frames(seed: int, count: int, width: int, height: int) -> bytes:
    """The fake runner's frames of ``seed``: every pixel of frame i is seed + i."""
    return b"".join(bytes([(seed + i) % 256]) * (width * height * 3) for i in range(count))


def test_a_video_streams_its_phases_and_chunks_which_reassemble_to_the_unary_result(
        stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    request = video_request(num_frames=5, fps=10, return_frames=True)
    events, done, chunks = streamed(stub, request)
    phases = [e.progress.phase for e in events if e.HasField("progress")]
    assert phases == [common_pb2.PROGRESS_PHASE_DENOISING] * 2 + [common_pb2.PROGRESS_PHASE_DECODING] + \
        [common_pb2.PROGRESS_PHASE_ENCODING] * 5
    video = done.videos[0]
    assert (video.data, video.frames) == (b"", b"")
    assert (video.mime_type, video.width, video.height, video.num_frames, video.fps, video.seed) == \
        ("video/mp4", 32, 32, 5, 10, 7)
    assert chunks[(0, True)] == flat_frames(7, 5, 32, 32)
    with av.open(io.BytesIO(chunks[(0, False)])) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 10
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    assert decoded.shape == (5, 32, 32, 3)
    expected = np.frombuffer(chunks[(0, True)], np.uint8).reshape(5, 32, 32, 3)
    assert np.abs(decoded.astype(int) - expected.astype(int)).max() <= 3

    # The unary result holds the same bytes (RAW: libx264 may choose another encoding of the same frames).
    raw = video_request(num_frames=5, output_format=W.OUTPUT_FORMAT_RAW)
    unary = stub.Generate(raw, timeout=60)
    assert not unary.images
    assert unary.videos[0].data == streamed(stub, raw)[2][(0, False)] == chunks[(0, True)]


def test_raw_frames_take_the_models_defaults_and_are_the_same_per_seed(
        stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    request = video_request(output_format=W.OUTPUT_FORMAT_RAW)
    first, second = (stub.Generate(request, timeout=60).videos[0] for _ in range(2))
    assert (first.num_frames, first.fps, first.mime_type) == (5, 8, "application/octet-stream")  # VIDEO's defaults
    assert first.data == second.data == flat_frames(7, 5, 32, 32)
    assert not first.frames  # RAW's data is the frames


def metric(name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as page:
        return next(float(line.split()[1]) for line in page.read().decode().splitlines()
                    if line.startswith(name + " "))


def test_videos_and_their_frames_are_counted(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    before = metric("diffusion_videos_generated_total"), metric("diffusion_video_frames_generated_total")
    stub.Generate(video_request(num_frames=9, output_format=W.OUTPUT_FORMAT_WEBP), timeout=60)
    assert (metric("diffusion_videos_generated_total"), metric("diffusion_video_frames_generated_total")) == \
        (before[0] + 1, before[1] + 9)


def test_webp_is_animated(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    video = stub.Generate(video_request(num_frames=5, output_format=W.OUTPUT_FORMAT_WEBP), timeout=60).videos[0]
    with Image.open(io.BytesIO(video.data)) as image:
        assert (image.format, image.n_frames, video.mime_type) == ("WEBP", 5, "image/webp")
        image.seek(4)
        assert np.asarray(image.convert("RGB")).max() == 7 + 4


def test_generate_refuses_frames_above_its_message_limit_and_names_generate_stream(
        stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    request = video_request(width=64, height=64, num_frames=9, output_format=W.OUTPUT_FORMAT_RAW)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "GenerateStream" in str(refused.value.details())
    _, _, chunks = streamed(stub, request)
    assert chunks[(0, False)] == flat_frames(7, 9, 64, 64)


@pytest.mark.parametrize(("fields", "field"), [
    ({"num_frames": 6}, "num_frames"),  # off the 4k+1 grid
    ({"num_frames": 21}, "num_frames"),  # above max_frames
    ({"fps": 31}, "fps"),
    ({"num_images": 2}, "num_images"),
    ({"output_format": W.OUTPUT_FORMAT_JPEG}, "output_format"),
])
def test_bad_video_fields_are_invalid_argument_naming_the_field(
        stub: worker_pb2_grpc.WorkerServiceStub, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(video_request(**fields), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = str(refused.value.details())
    assert details.startswith(f"{field}:") or f"; {field}:" in details


@pytest.mark.parametrize("fields", [{"output_format": W.OUTPUT_FORMAT_MP4}, {"num_frames": 5}, {"fps": 8},
                                    {"return_frames": True}])
def test_an_image_takes_no_video_fields(stub: worker_pb2_grpc.WorkerServiceStub, fields: dict[str, Any]) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(W.GenerateRequest(width=32, height=32, num_inference_steps=1, **fields), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert next(iter(fields)) in str(refused.value.details())


def test_a_video_held_on_one_runner_leaves_the_other_to_images_and_cancel_ends_it(
        stub: worker_pb2_grpc.WorkerServiceStub, fakes: FakeRunners) -> None:
    fakes.hold_videos()
    try:
        executes_before = [len(fake.executes) for fake in fakes.fakes]
        call = stub.GenerateStream(W.GenerateStreamRequest(request=video_request(request_id="held-video")), timeout=60)
        assert next(e for e in call if e.HasField("started")).started.request_id == "held-video"
        with ThreadPoolExecutor(3) as pool:
            images = list(pool.map(lambda seed: stub.Generate(W.GenerateRequest(
                width=32, height=32, num_inference_steps=2, seed=seed), timeout=60), range(3)))
        assert [len(r.images) for r in images] == [1, 1, 1]
        added = [fake.executes[before:] for fake, before in zip(fakes.fakes, executes_before, strict=True)]
        video_runner = next(i for i, executes in enumerate(added)
                            if any(e.items[0].task == common_pb2.TASK_TEXT_TO_VIDEO for e in executes))
        assert [e.items[0].request_id for e in added[video_runner]] == ["held-video"]
        assert sum(len(e.items) for e in added[1 - video_runner]) == 3

        assert stub.Cancel(W.CancelRequest(request_id="held-video"), timeout=10).was == "running"
        with pytest.raises(grpc.RpcError) as cancelled:
            list(call)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    finally:
        fakes.release_videos()
    # The runner serves the next video.
    assert stub.Generate(video_request(), timeout=60).videos[0].num_frames == 5


def test_frames_out_of_bounds_end_the_request_internal(stub: worker_pb2_grpc.WorkerServiceStub,
                                                       fakes: FakeRunners) -> None:
    for fake in fakes.fakes:
        fake.frame_shift = 4  # the last message's frames land past the fifth
    try:
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(video_request(num_frames=5), timeout=60)
    finally:
        for fake in fakes.fakes:
            fake.frame_shift = 0
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "frames" in str(failed.value.details())


# -- a real runner serving tiny-wan ----------------------------------------------------------------

@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A real runner and worker serving the built-in tiny-wan (text-to-video, frames 4k+1, 16-pixel grid)."""
    pair = start_pair(tmp_path_factory.mktemp("wan-pair"), "--model", "tiny-wan")
    try:
        with grpc.insecure_channel(pair.worker.target) as channel:
            yield worker_pb2_grpc.WorkerServiceStub(channel)
    finally:
        pair.stop()


def wan_request(**fields: Any) -> worker_pb2.GenerateRequest:
    return W.GenerateRequest(**{"prompt": "a kite", "width": 32, "height": 32, "num_frames": 5,
                                "num_inference_steps": 2, "seed": 3, **fields})


def test_tiny_wan_mp4_decodes_to_its_frames_and_raw_frames_are_the_same_per_seed(
        wan: worker_pb2_grpc.WorkerServiceStub) -> None:
    video = wan.Generate(wan_request(fps=12, return_frames=True), timeout=120).videos[0]
    assert (video.mime_type, video.num_frames, video.width, video.height, video.fps) == ("video/mp4", 5, 32, 32, 12)
    with av.open(io.BytesIO(video.data)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 12
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    frames = np.frombuffer(video.frames, np.uint8).reshape(5, 32, 32, 3)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 8  # yuv420p and H.264: close

    raw = [wan.Generate(wan_request(output_format=W.OUTPUT_FORMAT_RAW, seed=seed), timeout=120).videos[0].data
           for seed in (3, 3, 4)]
    assert raw[0] == raw[1] == video.frames and raw[2] != raw[0]


def test_tiny_wan_refuses_frames_off_its_grid_and_above_its_limit(wan: worker_pb2_grpc.WorkerServiceStub) -> None:
    caps = wan.GetStatus(W.GetStatusRequest(), timeout=10).model.capabilities.video
    for num_frames in (6, caps.max_frames + caps.frame_step):
        with pytest.raises(grpc.RpcError) as refused:
            wan.Generate(wan_request(num_frames=num_frames), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(refused.value.details()).startswith("num_frames:")


def test_tiny_wan_cancelled_mid_video_ends_cancelled_and_serves_the_next(
        wan: worker_pb2_grpc.WorkerServiceStub) -> None:
    call = wan.GenerateStream(W.GenerateStreamRequest(request=wan_request(request_id="wan-cancel",
                                                                          num_inference_steps=500)), timeout=120)
    assert next(e for e in call if e.HasField("progress")).progress.step >= 1
    assert wan.Cancel(W.CancelRequest(request_id="wan-cancel"), timeout=10).was == "running"
    with pytest.raises(grpc.RpcError) as cancelled:
        list(call)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    assert wan.Generate(wan_request(), timeout=120).videos[0].num_frames == 5


def test_a_video_runs_alone_in_its_execute_and_its_load_counts_its_frames() -> None:
    def job(request_id: str, **fields: Any) -> Job:
        model = common_pb2.ModelInfo(size_multiple=8, capabilities=common_pb2.ModelCapabilities(
            tasks=[common_pb2.TASK_TEXT_TO_IMAGE, common_pb2.TASK_TEXT_TO_VIDEO], video=VIDEO_CAPS))
        return Job(normalize(W.GenerateRequest(request_id=request_id, width=32, height=32, seed=1, **fields),
                             Limits(), set(), model=model), deadline=None)

    videos = [job(f"v{i}", task=common_pb2.TASK_TEXT_TO_VIDEO, num_frames=9) for i in range(2)]
    images = [job(f"i{i}") for i in range(2)]
    assert select_batch([*videos, *images], BatchPolicy(), now=0.0, fill=False) == ([videos[0]], None)
    assert select_batch([*images, *videos], BatchPolicy(), now=0.0, fill=False) == (images, None)
    assert load(videos[0]) == 9 * load(images[0])


@pytest.mark.slow
def test_kill_9_of_the_runner_mid_video_retries_it_with_the_same_frames(tmp_path: Path) -> None:
    """A video keeps the retry of images: its runner killed mid-denoising, it runs again on the
    restarted runner and its frames are those of an undisturbed run."""
    with running_pair(tmp_path, "--model", "tiny-wan", runner_args=("--threads", "1")) as pair:
        with grpc.insecure_channel(pair.worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            raw = wan_request(output_format=W.OUTPUT_FORMAT_RAW, num_inference_steps=40)
            baseline = stub.Generate(raw, timeout=300).videos[0].data
            stream = Stream(stub, raw, timeout=300)
            stream.wait_step(5)
            pair.restart_runner(signal.SIGKILL)
            stream.join(300)
            assert stream.error is None, stream.error
            assert stream.kinds.count("started") == 2
            chunks = [event.chunk for event in stream.events if event.HasField("chunk")]
            assert b"".join(chunk.data for chunk in chunks if not chunk.frames) == baseline
            assert stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].restarts == 1
