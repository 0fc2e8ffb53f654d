"""The request-level call's images and videos leave the device as uint8 (issue 40 item 4).

The pipeline is asked for ``output_type="pt"`` where its family's record says that is its ``"np"``
output before the conversion to numpy (``Family.tensor_output``); the images, converted to uint8 on
the device (``device_output.as_pixels``) and copied with the platform's ``to_host``, are byte for
byte those of the old path (the ``"np"`` output converted on the host), for image families, the
pipelines derived for image-to-image and inpainting, and video families. Kandinsky 3's ``"pt"``
output is its decoder's raw one, not in [0, 1], so it keeps ``"np"``, as a pipeline of no family
does. Counted by ``host_syncs.HostSyncs`` (tensors derived from the weights are on the "device"): a
request-level batch copies its images to the host once, one byte per channel; a video's frames a
quarter of the bytes the old path copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPAGPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from host_syncs import HostSyncs
from runner_calls import item
from runner_service.device_output import as_pixels, plain_copy
from runner_service.execution import ImageOutput, VideoOutput, image_inputs_of, run_batch
from runner_service.loaded_model import LoadedModel
from runner_service.pipeline_adapter import ImageInputs, ImageRows, PipelineAdapter, adapt, output_type_of
from serving_common.generation_params import GenerationParams
from serving_common.protocol import image_seed

pytestmark = pytest.mark.process  # builds the families' tiny models

STEPS = 2


def old_conversion(images: torch.Tensor) -> np.ndarray:
    """The path before: the call's ``"np"`` output (floats on the host), rounded by numpy."""
    return np.asarray((images.float().numpy() * 255).round().clip(0, 255).astype(np.uint8))


def source_image(size: int) -> Image.Image:
    ramp = np.linspace(0, 255, size * size * 3).reshape(size, size, 3)
    return Image.fromarray(ramp.astype(np.uint8))


@dataclass(frozen=True)
class Case:
    family: str
    size: int
    task: str = "TEXT_TO_IMAGE"


CASES = [Case("sd", 24), Case("sd", 24, "IMAGE_TO_IMAGE"), Case("sd", 24, "INPAINT"), Case("sdxl", 16),
         Case("sd3", 16), Case("flux", 16), Case("wuerstchen", 128), Case("wan", 16, "TEXT_TO_VIDEO"),
         Case("ltx", 32, "TEXT_TO_VIDEO")]


def generate(adapter: PipelineAdapter, case: Case, seeds: list[int]) -> torch.Tensor:
    capabilities = adapter.capabilities
    video = capabilities.video
    inputs = {"IMAGE_TO_IMAGE": ImageInputs([source_image(case.size)] * len(seeds), None, 0.6),
              "INPAINT": ImageInputs([source_image(case.size)] * len(seeds),
                                     [Image.new("L", (case.size, case.size), 255)] * len(seeds), 0.6)}.get(case.task)
    call = GenerationParams(width=case.size, height=case.size, num_inference_steps=STEPS,
                            guidance_scale=capabilities.default_guidance or 2.0,
                            num_frames=video.frame_step + 1 if video is not None else 0)
    with torch.inference_mode():
        return adapter.for_task(case.task).generate(ImageRows.of("a red fox", "", seeds), call,
                                                    lambda done, total: None, inputs)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.family}-{case.task.lower()}")
def test_the_device_output_is_the_old_paths_bytes(case: Case,
                                                  family_pipeline: Callable[[str], DiffusionPipeline]) -> None:
    adapter = adapt(family_pipeline(case.family))
    assert adapter.for_task(case.task).output_type == "pt"
    old = generate(replace(adapter, output_type="np", _derived={}), case, [1, 2])
    made = generate(adapter, case, [1, 2])
    assert made.shape == old.shape and made.dtype.is_floating_point
    pixels = plain_copy(as_pixels(made))
    assert pixels.dtype == np.uint8
    assert np.array_equal(pixels, old_conversion(old))
    assert pixels.std() > 0  # not a blank image


def test_kandinsky3_keeps_numpy_output_whose_tensor_output_is_not_in_the_unit_range(
        family_pipeline: Callable[[str], DiffusionPipeline]) -> None:
    adapter = adapt(family_pipeline("kandinsky3"))
    assert adapter.output_type == "np"
    case = Case("kandinsky3", 64)
    forced = generate(replace(adapter, output_type="pt"), case, [1])
    assert float(forced.min()) < 0  # the MoVQ's [-1, 1]: as_pixels would clamp, not map, it
    made = generate(adapter, case, [1])
    assert float(made.min()) >= 0 and made.device.type == "cpu"


def test_a_pipeline_of_no_family_keeps_numpy_output(family_pipeline: Callable[[str], DiffusionPipeline]) -> None:
    sd = family_pipeline("sd")
    assert output_type_of(sd) == "pt"
    assert output_type_of(StableDiffusionPAGPipeline.from_pipe(sd)) == "np"


# -- a request-level batch through run_batch, its copies to the host counted ------------------------

def loaded(name: str, cpu_platform: Any) -> LoadedModel:
    from runner_service.loaded_model import check_source, load_model
    from runner_service.model_roots import ModelRoots
    from runner_service.model_sources import HubCache

    return load_model(check_source(name, None, ModelRoots(), HubCache()), None, cpu_platform)


def counted_run(model: LoadedModel, items: list[runner_pb2.ExecuteItem]) -> tuple[HostSyncs, list[Any]]:
    syncs = HostSyncs()
    syncs.modules_on_device(module for module in model.pipeline.components.values()
                            if isinstance(module, torch.nn.Module))
    with syncs:
        outputs = run_batch(model, items, lambda _: None, threading.Event(), to_host=plain_copy)
    return syncs, outputs


def old_path(model: LoadedModel, items: list[runner_pb2.ExecuteItem]) -> tuple[HostSyncs, np.ndarray]:
    """The batch's pixels as the old path made them (the call's "np" output, converted on the host),
    the call's copies to the host counted."""
    seeds = [image_seed(each.seed, index) for each in items for index in range(each.num_images)]
    rows = ImageRows([each.prompt for each in items for _ in range(each.num_images)], [""] * len(seeds),
                     [torch.Generator("cpu").manual_seed(seed) for seed in seeds])
    syncs = HostSyncs()
    syncs.modules_on_device(module for module in model.pipeline.components.values()
                            if isinstance(module, torch.nn.Module))
    with syncs, torch.inference_mode():
        images = replace(model.adapter, output_type="np", _derived={}).generate(
            rows, GenerationParams.from_item(items[0]), lambda done, total: None, image_inputs_of(items))
    return syncs, old_conversion(images)


def test_a_request_level_batch_copies_its_images_once_as_uint8(cpu_platform: Any) -> None:
    tiny = loaded("tiny", cpu_platform)
    size = 32
    items = [item(seed=1, steps=STEPS, size=size, num_images=2), item(seed=7, steps=STEPS, size=size)]
    syncs, outputs = counted_run(tiny, items)
    counts = syncs.counts
    assert len(counts.transfers) == 1, counts.events
    assert counts.bytes_to_host == 3 * size * size * 3
    old_syncs, old = old_path(tiny, items)
    assert old_syncs.counts.bytes_to_host == 4 * counts.bytes_to_host  # float32 before
    assert all(isinstance(output, ImageOutput) for output in outputs)
    assert np.array_equal(np.stack([output.pixels for output in outputs]), old)


def test_a_videos_frames_leave_the_device_as_uint8(cpu_platform: Any) -> None:
    wan = loaded("tiny-wan", cpu_platform)
    size, frames = 32, 9
    video = item(seed=3, steps=STEPS, size=size, guidance_scale=5.0, task=common_pb2.TASK_TEXT_TO_VIDEO,
                 num_frames=frames)
    syncs, [output] = counted_run(wan, [video])
    counts = syncs.counts
    assert isinstance(output, VideoOutput) and output.frames.dtype == np.uint8
    assert len(counts.transfers) == 1, counts.events
    assert counts.bytes_to_host == frames * size * size * 3  # a byte per channel of each frame
    old_syncs, [old] = old_path(wan, [video])
    assert old_syncs.counts.bytes_to_host == 4 * counts.bytes_to_host
    assert np.array_equal(output.frames, old)
