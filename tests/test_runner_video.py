"""Video on the runner: Wan text- and image-to-video through a real runner process (frames, their
ExecuteFrames messages, progress phases, cancel, frame rules) and the VAE decode's tiles and
cancellation in process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from diffusion.v1 import common_pb2, runner_pb2
from harness.processes import ServiceProcess, start_runner, wait_until
from runner_calls import info, item, runner_stub
from serving_common.errors import field_violations

pytestmark = pytest.mark.process

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_FRAMES = 29
DECODING = common_pb2.PROGRESS_PHASE_DECODING
DENOISING = common_pb2.PROGRESS_PHASE_DENOISING


@pytest.fixture(scope="module")
def video_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A runner with 1 MiB messages and --max-frames 29, serving tiny-wan."""
    process = start_runner(tmp_path_factory.mktemp("video-runner"), "--model", "tiny-wan",
                           "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-frames", str(MAX_FRAMES))
    yield process
    process.stop()


def loaded(process: ServiceProcess, source: str) -> Any:
    stub = runner_stub(process.target)
    if info(stub).model.source != source:
        stub.LoadModel(runner_pb2.LoadModelRequest(source=source), timeout=120)
    return stub


def video_item(frames: int = 9, size: int = 32, steps: int = 2, **fields: Any) -> runner_pb2.ExecuteItem:
    fields.setdefault("task", common_pb2.TASK_TEXT_TO_VIDEO)
    return item(seed=fields.pop("seed", 3), steps=steps, size=size, prompt="a red fox running",
                guidance_scale=fields.pop("guidance_scale", 5.0), num_frames=frames, **fields)


def run(stub: Any, request: runner_pb2.ExecuteItem) -> tuple[list[Any], list[Any], runner_pb2.ExecuteResult]:
    """(progress events, ExecuteFrames messages, result) of one video."""
    events = list(stub.Execute(runner_pb2.ExecuteRequest(items=[request], progress=True)))
    assert events[-1].HasField("result")
    return ([e.progress for e in events if e.HasField("progress")],
            [e for e in events if e.HasField("frames")], events[-1].result)


def assembled(messages: list[Any], video: runner_pb2.RawVideo) -> np.ndarray:
    """The video's frames from its ExecuteFrames, each frame present once, in order."""
    frame_bytes = video.width * video.height * 3
    frames = np.zeros((video.num_frames, video.height, video.width, 3), np.uint8)
    seen: list[int] = []
    for message in (m.frames for m in messages):
        assert len(message.pixels) % frame_bytes == 0
        count = len(message.pixels) // frame_bytes
        frames[message.first_frame:message.first_frame + count] = np.frombuffer(
            message.pixels, np.uint8).reshape(count, video.height, video.width, 3)
        seen.extend(range(message.first_frame, message.first_frame + count))
    assert seen == list(range(video.num_frames))
    return frames


def pipeline_frames(source: str, request: runner_pb2.ExecuteItem, **arguments: Any) -> np.ndarray:
    """The frames the pipeline's own ``__call__`` makes for the request, as uint8."""
    from diffusers import DiffusionPipeline

    from runner_service.models.catalog import ensure_builtin

    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(source))
    pipeline.set_progress_bar_config(disable=True)
    output = pipeline(prompt=request.prompt, negative_prompt="", num_frames=request.num_frames,
                      width=request.width, height=request.height, num_inference_steps=request.num_inference_steps,
                      guidance_scale=request.guidance_scale, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(request.seed), **arguments)
    return (np.asarray(output.frames[0]) * 255).round().clip(0, 255).astype(np.uint8)


def test_capabilities_report_the_video_grid_within_max_frames(video_runner):
    model = info(loaded(video_runner, "tiny-wan")).model
    capabilities = model.capabilities
    assert list(capabilities.tasks) == [common_pb2.TASK_TEXT_TO_VIDEO]
    video = capabilities.video
    assert (video.frame_step, video.min_frames, video.max_frames) == (4, 1, MAX_FRAMES)
    assert video.default_frames == MAX_FRAMES  # Wan's 81, within --max-frames
    assert video.min_fps <= video.default_fps == 16 <= video.max_fps
    assert (model.size_multiple, model.min_size) == (16, 16)


def test_frames_equal_the_pipeline_and_progress_denoises_then_decodes(video_runner):
    stub = loaded(video_runner, "tiny-wan")
    request = video_item()
    progress, messages, result = run(stub, request)
    [output] = result.outputs
    assert not output.images
    [video] = output.videos
    assert (video.width, video.height, video.num_frames, video.seed) == (32, 32, 9, 3)
    frames = assembled(messages, video)
    expected = pipeline_frames("tiny-wan", request)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1
    assert frames.std() > 0  # not a blank video
    # Denoising steps, then the decoder's calls: one per latent frame ((9 - 1) / 4 + 1).
    assert [(p.phase, p.step, p.total_steps) for p in progress] == [
        (DENOISING, 1, 2), (DENOISING, 2, 2), (DECODING, 1, 3), (DECODING, 2, 3), (DECODING, 3, 3)]
    _, again, _ = run(stub, request)
    assert np.array_equal(assembled(again, video), frames)
    _, other, _ = run(stub, video_item(seed=4))
    assert not np.array_equal(assembled(other, video), frames)


def test_frames_come_in_messages_within_the_limit(video_runner):
    stub = loaded(video_runner, "tiny-wan")
    request = video_item(frames=25, size=128, steps=1)
    _, messages, result = run(stub, request)
    [video] = result.outputs[0].videos
    assert video.num_frames * 128 * 128 * 3 > MAX_MESSAGE_BYTES
    assert len(messages) > 1
    assert all(message.ByteSize() <= MAX_MESSAGE_BYTES for message in messages)
    assert {message.frames.request_id for message in messages} == {request.request_id}
    assert assembled(messages, video).shape == (25, 128, 128, 3)


@pytest.mark.parametrize(("fields", "field"), [
    ({"frames": 10}, "items[0].num_frames"),
    ({"frames": MAX_FRAMES + 4}, "items[0].num_frames"),
    ({"frames": 0}, "items[0].num_frames"),
    ({"num_images": 2}, "items[0].num_images"),
])
def test_bad_frames_are_invalid_argument_naming_the_field(video_runner, fields, field):
    stub = loaded(video_runner, "tiny-wan")
    with pytest.raises(grpc.RpcError) as error:
        run(stub, video_item(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(error.value)


def test_two_videos_in_one_execute_are_refused(video_runner):
    stub = loaded(video_runner, "tiny-wan")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Execute(runner_pb2.ExecuteRequest(items=[video_item(), video_item(seed=5, request_id="b")])))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items" in field_violations(error.value)


def test_cancel_mid_video_stops_it_and_frees_the_runner(video_runner):
    stub = loaded(video_runner, "tiny-wan")
    call = stub.Execute(runner_pb2.ExecuteRequest(items=[video_item(steps=500, request_id="long")], progress=True))
    seen: list[Any] = []

    def consume() -> None:
        try:
            for event in call:
                seen.append(event)
                if len(seen) == 2:
                    call.cancel()
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=consume)
    reader.start()
    reader.join(120)
    assert not reader.is_alive() and len(seen) == 2
    wait_until(lambda: "stopped after step" in video_runner.log(), 60, "the runner to stop the cancelled video")
    progress, _, result = run(stub, video_item(steps=1))
    assert result.outputs[0].videos[0].num_frames == 9
    assert progress[0].step == 1


def test_image_to_video_equals_the_pipeline(video_runner):
    from PIL import Image

    stub = loaded(video_runner, "tiny-wan-i2v")
    capabilities = info(stub).model.capabilities
    assert list(capabilities.tasks) == [common_pb2.TASK_IMAGE_TO_VIDEO]
    rng = np.random.default_rng(0)
    start = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = runner_pb2.RawImage(pixels=start.tobytes(), width=32, height=32, channels=3)
    request = video_item(frames=5, task=common_pb2.TASK_IMAGE_TO_VIDEO, image=image)
    _, messages, result = run(stub, request)
    frames = assembled(messages, result.outputs[0].videos[0])
    expected = pipeline_frames("tiny-wan-i2v", request, image=Image.fromarray(start))
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1
    with pytest.raises(grpc.RpcError) as error:
        run(stub, video_item(frames=5, task=common_pb2.TASK_IMAGE_TO_VIDEO))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].image" in field_violations(error.value)


# -- the decode, in process ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan(cpu_platform: Any) -> Any:
    from runner_service.loaded_model import check_source, load_model
    from runner_service.model_roots import ModelRoots
    from runner_service.model_sources import HubCache

    return load_model(check_source("tiny-wan", None, ModelRoots(), HubCache()), None, cpu_platform)


def test_a_cancelled_video_stops_between_decoder_calls(wan):
    from runner_service.execution import ExecutionCancelled, StepProgress, run_batch

    cancelled = threading.Event()
    seen: list[StepProgress] = []

    def on_step(event: StepProgress) -> None:
        seen.append(event)
        if event.phase == DECODING:
            cancelled.set()

    with pytest.raises(ExecutionCancelled):
        run_batch(wan, [video_item(frames=13, steps=1)], on_step, cancelled)
    assert [(e.phase, e.step, e.total_steps) for e in seen] == [(DENOISING, 1, 1), (DECODING, 1, 4)]


def test_budget_tiles_are_counted_and_the_vae_keeps_its_settings(wan):
    from runner_service.video_decode import TILE_FIELDS, DecodeOverBudget, Tiling, decoding, estimate, tiles_within

    vae = wan.pipeline.vae
    own = {name: getattr(vae, name) for name in TILE_FIELDS}
    latents = torch.randn(1, 16, 3, 12, 12, generator=torch.Generator().manual_seed(0))  # 9 frames, 96x96
    calls: list[tuple[int, int]] = []

    def decode(tiling: Tiling | None) -> np.ndarray:
        calls.clear()
        with torch.inference_mode(), decoding(vae, tiling, 9, 96, 96, lambda done, total: calls.append((done, total))):
            frames: np.ndarray = vae.decode(latents, return_dict=False)[0].float().numpy()
        assert {name: getattr(vae, name) for name in TILE_FIELDS} == own
        return frames

    found = estimate(vae, 9, 96, 96)
    assert found is not None
    assert tiles_within(vae, found.peak(Tiling(0, 0)), 9, 96, 96) == Tiling(0, 0)
    whole = decode(Tiling(0, 0))
    assert calls == [(1, 3), (2, 3), (3, 3)]  # one per latent frame
    assert np.array_equal(decode(Tiling(96, 72)), whole)  # a tile covering the frame is no tiling
    small = tiles_within(vae, found.peak(Tiling(32, 24)), 9, 96, 96)
    assert small == Tiling(32, 24)
    tiled = decode(small)
    # 3 latent frames x 4 x 4 tiles (latent 12 wide in strides of 3), the total known from the start.
    assert calls == [(done, 48) for done in range(1, 49)]
    assert tiled.shape == whole.shape
    with pytest.raises(DecodeOverBudget):  # not even the smallest tiles fit
        tiles_within(vae, found.peak(Tiling(32, 24)) - 1, 9, 96, 96)


def test_a_video_over_the_decode_budget_is_refused_before_it_runs(wan):
    from runner_service.execution import StepProgress, run_batch
    from serving_common.errors import ServiceError

    seen: list[StepProgress] = []
    with pytest.raises(ServiceError) as error:
        run_batch(wan, [video_item()], seen.append, threading.Event(), decode_budget=1024 * 1024)
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--decode-budget-bytes" in str(error.value.message)
    assert not seen  # nothing ran
