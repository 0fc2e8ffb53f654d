"""Every video family's tiny build through a real runner, with the guarantees image families have.

Each video family (``runner_service.families.VIDEO``: Wan text-to-video and image-to-video)
is loaded from its tiny build (``fixtures_families``) into the session's shared runner, whose
LoadModel ends only after the one-step canary, and then checked through the runner's own calls:
the video capabilities its record's grid gives, the fewest frames at the smallest size in one step,
the same frames after sleep levels 1 and 2, after LoadWeights of its own files and after PushWeights
of its own tensors, and a LoRA on its transformer that changes the frames at scale 1 and gives
exactly the base frames at scale 0. The tests of one family run together (a module-scoped
parametrized fixture), so each family is loaded once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from diffusion.v1 import common_pb2, runner_pb2
from lora_files import make_transformer_lora
from runner_calls import runner_stub
from runner_service.families import FAMILIES, VIDEO
from runner_service.platforms.cpu import CpuPlatform
from serving_common.tensor_stream import push_messages

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 2
FRAMES = 5
SIZE = 32


class VideoFamily:
    """One video family loaded in the shared runner: its name, directory, stub, ModelInfo and baseline frames."""

    def __init__(self, name: str, directory: Path, stub, model: common_pb2.ModelInfo) -> None:
        self.name, self.directory, self.stub, self.model = name, directory, stub, model
        self.task = model.capabilities.tasks[0]
        self.baseline = self.frames()

    def item(self, frames: int = FRAMES, size: int = SIZE, steps: int = STEPS, **fields) -> runner_pb2.ExecuteItem:
        """A one-video item; image-to-video starts from a seeded random picture of the video's size."""
        if self.task == common_pb2.TASK_IMAGE_TO_VIDEO:
            picture = np.random.RandomState(3).randint(0, 255, (size, size, 3)).astype(np.uint8)
            fields["image"] = runner_pb2.RawImage(pixels=picture.tobytes(), width=size, height=size, channels=3)
        return runner_pb2.ExecuteItem(
            request_id=f"video-{self.name}", prompt="a red fox running in the snow", width=size, height=size,
            num_inference_steps=steps, guidance_scale=self.model.capabilities.default_guidance_scale, seed=5,
            num_images=1, task=self.task, num_frames=frames, **fields)

    def frames(self, frames: int = FRAMES, size: int = SIZE, steps: int = STEPS, **fields) -> np.ndarray:
        """The video's frames (frames x H x W x 3, uint8), from the ExecuteFrames messages before the
        result, which must cover every frame exactly once, in order."""
        events = list(self.stub.Execute(runner_pb2.ExecuteRequest(items=[self.item(frames, size, steps, **fields)]),
                                         timeout=120))
        assert events[-1].HasField("result"), events[-1]
        video = events[-1].result.outputs[0].videos[0]
        assert (video.num_frames, video.width, video.height, video.seed) == (frames, size, size, 5)
        parts = [event.frames for event in events if event.HasField("frames")]
        frame_bytes = size * size * 3
        covered = 0
        for part in parts:
            assert (part.video_index, part.first_frame) == (0, covered)
            assert len(part.pixels) % frame_bytes == 0
            covered += len(part.pixels) // frame_bytes
        assert covered == frames
        return np.frombuffer(b"".join(part.pixels for part in parts), np.uint8).reshape(frames, size, size, 3)


@pytest.fixture(scope="module", params=VIDEO)
def family(request, shared_runner, family_directory) -> Iterator[VideoFamily]:
    name = request.param
    directory = family_directory(name)
    stub = runner_stub(shared_runner.target)
    info = stub.LoadModel(runner_pb2.LoadModelRequest(source=str(directory)), timeout=300).info
    yield VideoFamily(name, directory, stub, info.model)


def test_load_reports_the_video_grid_its_record_gives(family, family_pipeline):
    """The tasks, sizes and frame counts the runner reports are those of the family record, read from
    the configs of the same build loaded in this process."""
    record = FAMILIES[family.name]
    assert record.video is not None
    grid = record.video.grid(family_pipeline(family.name))
    model, video = family.model, family.model.capabilities.video
    expected_task = common_pb2.TASK_IMAGE_TO_VIDEO if record.pipeline_class.endswith("ImageToVideoPipeline") \
        else common_pb2.TASK_TEXT_TO_VIDEO
    assert list(model.capabilities.tasks) == [expected_task]
    assert model.pipeline_class == record.pipeline_class
    # The runner reports the largest side it generates: the model's own, within a CPU runner's 512.
    largest = CpuPlatform.default_max_size
    assert model.min_size == record.smallest_size and model.max_size == min(grid.max_size or largest, largest)
    assert video.frame_step == grid.frame_step and video.min_frames == 1
    # Without a limit of the model's own, the runner's --max-frames bounds it.
    assert video.max_frames == grid.max_frames if grid.max_frames else video.max_frames > 0
    assert video.min_frames <= video.default_frames <= video.max_frames
    assert (video.default_frames - 1) % video.frame_step == 0
    assert video.min_fps <= video.default_fps == record.video.default_fps <= video.max_fps


def test_the_fewest_frames_at_the_smallest_size_in_one_step(family):
    """What the canary ran at load: one step of the fewest frames at the smallest size."""
    fewest, smallest = family.model.capabilities.video.min_frames, family.model.min_size
    frames = family.frames(frames=fewest, size=smallest, steps=1)
    assert frames.shape == (fewest, smallest, smallest, 3)
    assert np.array_equal(family.frames(frames=fewest, size=smallest, steps=1), frames)


def test_frames_are_the_same_for_the_same_seed_and_differ_frame_to_frame(family):
    assert np.array_equal(family.frames(), family.baseline)
    assert len({frame.tobytes() for frame in family.baseline}) == FRAMES


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_frames(family, level):
    slept = family.stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=level), timeout=60)
    assert slept.info.model.sleep_level == level
    family.stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest(), timeout=120)
    assert np.array_equal(family.frames(), family.baseline)


def own_tensors(directory: Path, component: str) -> dict:
    """A component's tensors as its files hold them, named ``<component>.<name as saved>``."""
    files = sorted((directory / component).glob("*.safetensors"))
    assert files, component
    saved: dict = {}
    for file in files:
        saved.update(load_file(file))
    return {f"{component}.{key}": value.contiguous() for key, value in sorted(saved.items())}


def test_load_weights_of_its_own_files_changes_nothing(family, tmp_path):
    for component in family.model.components:
        tensors = own_tensors(family.directory, component.name)
        path = tmp_path / f"{family.name}-{component.name}.safetensors"
        save_file(tensors, str(path))
        loaded = family.stub.LoadWeights(runner_pb2.RunnerServiceLoadWeightsRequest(path=str(path)), timeout=120)
        assert sorted(loaded.loaded_names) == sorted(tensors), component.name
    assert np.array_equal(family.frames(), family.baseline)


def test_push_weights_of_its_own_tensors_changes_nothing(family):
    checksum = family.stub.GetWeightsChecksum(runner_pb2.RunnerServiceGetWeightsChecksumRequest(), timeout=60).checksum
    tensors = own_tensors(family.directory, "transformer")
    messages = push_messages(((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numpy().tobytes())
                              for name, t in tensors.items()), 64 * 1024)
    requests = (runner_pb2.RunnerServicePushWeightsRequest.FromString(message) for message, _ in messages)
    reply = family.stub.PushWeights(requests, timeout=120)
    assert sorted(reply.loaded_names) == sorted(tensors) and reply.checksum == checksum
    assert np.array_equal(family.frames(), family.baseline)


def test_a_lora_on_its_transformer_changes_the_frames_and_scale_zero_gives_the_base(family, tmp_path):
    path = make_transformer_lora(tmp_path / f"{family.name}-lora.safetensors", seed=7, family=family.name)
    name = f"{family.name}-lora"
    family.stub.LoadAdapter(runner_pb2.RunnerServiceLoadAdapterRequest(name=name, path=str(path)), timeout=120)
    try:
        adapted = family.frames(adapters=[common_pb2.AdapterRef(name=name, scale=1.0)])
        assert not np.array_equal(adapted, family.baseline)
        assert np.array_equal(family.frames(adapters=[common_pb2.AdapterRef(name=name)]), adapted)
        assert np.array_equal(family.frames(adapters=[common_pb2.AdapterRef(name=name, scale=0.0)]), family.baseline)
    finally:
        family.stub.UnloadAdapter(runner_pb2.RunnerServiceUnloadAdapterRequest(name=name), timeout=60)
    assert np.array_equal(family.frames(), family.baseline)
