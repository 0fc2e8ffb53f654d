"""Image-to-image and inpainting step-level, for every family whose loop runs them, in process:
a text-to-image sequence runs alone for three steps, then an image-to-image or inpainting one
(strength 0.5 of 6 steps: the last 3 of the schedule) joins it in the same denoiser calls, and
each image equals the one the task's own ``__call__`` (the derived pipeline, through the pipeline
adapter) makes for it alone within 1/255. One served test runs an inpainting request into a
running text-to-image batch of a real runner, against the derived pipeline's own call with the
runner's post-processing (``keep_unmasked``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_calls import item, pixels, runner_stub
from runner_service.denoising.loop import ImageSource, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.execution import keep_unmasked
from runner_service.families import FAMILIES, loop_for
from runner_service.models.catalog import ensure_builtin
from runner_service.pipeline_adapter import ImageInputs, ImageRows, adapt
from runner_service.step_engine import decode_finished
from serving_common.generation_params import GenerationParams
from tests.test_step_batching import Execution

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
STEPS = 6
STRENGTH = 0.5  # 3 of the 6 steps run
JOIN_AT = 3  # the image sequence joins after step 3 of the text one: both finish together
FAMILY_NAMES = ("sd", "sdxl", "sd3", "flux", "kandinsky3")
IMAGE_TASKS = ("IMAGE_TO_IMAGE", "INPAINT")


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


def picture(size: int) -> Image.Image:
    """An input image: a colour gradient with some noise, the same for every run."""
    ramp = np.linspace(0, 255, size)
    noise = np.random.default_rng(7).integers(0, 40, (size, size, 3))
    channels = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) / 2 + 128,
                         np.full((size, size), 90.0)], axis=-1)
    return Image.fromarray((channels + noise).clip(0, 255).astype(np.uint8), "RGB")


def mask(size: int) -> Image.Image:
    """White (repainted) in the middle, black (kept) around it."""
    pixels = np.zeros((size, size), np.uint8)
    pixels[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return Image.fromarray(pixels, "L")


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    pipeline = FAMILIES[request.param].build()
    pipeline.set_progress_bar_config(disable=True)
    return request.param, pipeline, adapt(pipeline).canary()


@pytest.mark.parametrize("task", IMAGE_TASKS)
def test_an_image_sequence_joining_a_text_one_equals_the_tasks_own_call(family, task):
    name, pipeline, adapter = family
    capabilities = adapter.capabilities
    if task not in capabilities.tasks:
        pytest.skip(f"{name}'s tiny build does not serve {task}")
    loop = loop_for(pipeline, CPU)
    assert loop is not None and task in loop.tasks, f"{name}'s loop does not run {task}"
    size = -(-max(capabilities.min_size, 16) // capabilities.size_multiple) * capabilities.size_multiple
    guidance = max(capabilities.default_guidance, 2.0)
    true_cfg = 2.0 if capabilities.separate_true_cfg else 0.0
    inputs = ImageInputs([picture(size)], [mask(size)] if task == "INPAINT" else None, STRENGTH)
    derived = adapter.for_task(task)
    text = SequenceSpec("a red circle on blue", "blurry", size, size, STEPS, guidance, 11, (), true_cfg)
    image = SequenceSpec("a green square", "dark", size, size, STEPS, guidance + 1, 12, (), true_cfg,
                         source=ImageSource(task, derived.pipeline, inputs.images[0], STRENGTH,
                                            inputs.masks[0] if inputs.masks else None))

    def own(spec: SequenceSpec, on: object, image_inputs: ImageInputs | None) -> np.ndarray:
        with torch.inference_mode():
            return uint8(on.generate(
                ImageRows.of(spec.prompt, spec.negative_prompt, [spec.seed]),
                GenerationParams(width=spec.width, height=spec.height, num_inference_steps=spec.steps,
                                 guidance_scale=spec.guidance,
                                 true_cfg_scale=spec.true_cfg if capabilities.separate_true_cfg else None),
                lambda done, total: None, image_inputs))[0]

    cache = PromptCache()
    with torch.inference_mode():
        first = loop.start(text, cache, "v")
        for _ in range(JOIN_AT):
            loop.step([first])
        second = loop.start(image, cache, "v")
        assert second.total == STEPS // 2, "the strength's shorter schedule"
        while not (first.finished and second.finished):
            loop.step([first, second])
        decoded = decode_finished(loop, [first, second])  # one size: decoded together
    for label, served, expected in [("text", decoded[id(first)], own(text, adapter, None)),
                                    (task, decoded[id(second)], own(image, derived, inputs))]:
        difference = int(np.abs(served.astype(int) - expected.astype(int)).max())
        assert difference <= 1, f"{name} {label}: differs by {difference}/255 from __call__"


SERVED_SIZE = 32


@pytest.mark.process
def test_a_served_inpainting_request_joins_a_running_text_batch(shared_runner):
    """Through a real runner (``tiny``, step batching on): an inpainting request joins a running
    text-to-image one at a step boundary, runs its strength's 3 steps, keeps its input's pixels
    outside the mask, and its image is the derived pipeline's own, with the input's pixels kept."""
    stub = runner_stub(shared_runner.target)
    stub.LoadModel(runner_pb2.LoadModelRequest(source="tiny"), timeout=120)
    source, hole = picture(SERVED_SIZE), mask(SERVED_SIZE)
    inpaint = item(seed=6, steps=STEPS, size=SERVED_SIZE, request_id="inpaint", task=common_pb2.TASK_INPAINT,
                   strength=STRENGTH, image=runner_pb2.RawImage(width=SERVED_SIZE, height=SERVED_SIZE, channels=3,
                                                                pixels=source.tobytes()),
                   mask_image=runner_pb2.RawImage(width=SERVED_SIZE, height=SERVED_SIZE, channels=1,
                                                  pixels=hole.tobytes()))
    text = item(seed=5, steps=16, size=SERVED_SIZE, request_id="text")
    first = Execution(stub, text)
    first.wait_for_step(3)
    second = Execution(stub, inpaint)
    joined = second.join()
    assert first.result is None and len(first.steps) < 16, first.steps
    assert second.steps == [1, 2, 3]
    first.join()
    served = pixels(joined)
    kept = np.asarray(hole) == 0
    assert (served[kept] == np.asarray(source)[kept]).all()
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin("tiny", None), torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    inputs = ImageInputs([source], [hole], STRENGTH)
    with torch.inference_mode():
        own = adapt(pipeline).for_task("INPAINT").generate(
            ImageRows.of(inpaint.prompt, "", [6]),
            GenerationParams(width=SERVED_SIZE, height=SERVED_SIZE, num_inference_steps=STEPS,
                             guidance_scale=inpaint.guidance_scale),
            lambda done, total: None, inputs)
    expected = keep_unmasked(uint8(own), inputs)[0]
    assert int(np.abs(served.astype(int) - expected.astype(int)).max()) <= 1
