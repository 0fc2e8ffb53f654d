"""The T5 prompt length: a model whose T5 tokenizer reads fewer tokens than the call's default
``max_sequence_length`` (the shapes model's reads 12, Flux's call pads to 512) gets its prompts
encoded at the tokenizer's length by the pipeline adapter, for text-to-image and for the
image-to-image and inpaint pipelines it derives, and by the step-level loop: each makes the image
diffusers' own call makes when told that length. In-process, on the tiny Flux build with its T5
tokenizer cut to 8 tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from PIL import Image

from runner_service.denoising.loop import SequenceSpec, max_sequence_length
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import FAMILIES, loop_for
from runner_service.pipeline_adapter import ImageInputs, ImageRows, adapt
from serving_common.generation_params import GenerationParams

pytestmark = pytest.mark.process

LENGTH = 8
SIZE = 16
STEPS = 2
GUIDANCE = 3.5
CALL = GenerationParams(width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE)
PROMPT = "a red fox"
GREY, WHITE = Image.new("RGB", (SIZE, SIZE), (128, 128, 128)), Image.new("L", (SIZE, SIZE), 255)


@pytest.fixture(scope="module")
def flux() -> DiffusionPipeline:
    pipeline = FAMILIES["flux"].build()
    pipeline.tokenizer_2.model_max_length = LENGTH
    pipeline.set_progress_bar_config(disable=True)  # type: ignore[no-untyped-call]
    return pipeline


def generator() -> torch.Generator:
    return torch.Generator("cpu").manual_seed(3)


def own(pipeline: Any, **arguments: Any) -> np.ndarray:
    """Diffusers' own call, as uint8."""
    with torch.inference_mode():
        images = pipeline(prompt=[PROMPT], negative_prompt=[""], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                          generator=[generator()], width=SIZE, height=SIZE, output_type="np", **arguments).images
    return as_pixels(np.asarray(images))


def as_pixels(images: np.ndarray | torch.Tensor) -> np.ndarray:
    return (torch.as_tensor(images).float().numpy() * 255).round().clip(0, 255).astype(np.int16)


def test_the_adapter_and_the_loop_encode_prompts_at_the_tokenizers_length(flux):
    reference = own(flux, max_sequence_length=LENGTH)
    assert np.abs(reference - own(flux)).max() > 0  # the call's default, 512 tokens, makes another image
    with torch.inference_mode():
        served = adapt(flux).generate(ImageRows([PROMPT], [""], [generator()]), CALL, lambda done, total: None)
        loop = loop_for(flux, torch.device("cpu"))
        assert loop is not None
        sequence = loop.start(SequenceSpec(PROMPT, "", SIZE, SIZE, STEPS, GUIDANCE, 3, ()), PromptCache(0), "")
        while not sequence.finished:
            loop.step([sequence])
        stepped = loop.decode([sequence]).numpy()
    assert np.abs(as_pixels(served) - reference).max() <= 1
    assert np.abs(as_pixels(stepped) - reference).max() <= 1


@pytest.mark.parametrize(("task", "inputs", "derived"), [
    ("IMAGE_TO_IMAGE", ImageInputs([GREY], strength=0.8), FluxImg2ImgPipeline),
    ("INPAINT", ImageInputs([GREY], [WHITE], strength=0.8), FluxInpaintPipeline),
])
def test_the_derived_pipelines_encode_prompts_at_the_tokenizers_length(flux, task, inputs, derived):
    arguments: dict[str, Any] = {"image": inputs.images, "strength": inputs.strength}
    if inputs.masks is not None:
        arguments["mask_image"] = inputs.masks
    pipeline = derived.from_pipe(flux)
    pipeline.set_progress_bar_config(disable=True)
    reference = own(pipeline, max_sequence_length=LENGTH, **arguments)
    assert np.abs(reference - own(pipeline, **arguments)).max() > 0
    with torch.inference_mode():
        served = adapt(flux).for_task(task).generate(ImageRows([PROMPT], [""], [generator()]), CALL,
                                                     lambda done, total: None, inputs)
    assert np.abs(as_pixels(served) - reference).max() <= 1


def test_a_real_length_stays_the_calls_default():
    """The tiny builds' T5 reads 512 tokens, as a real one: no argument, whatever the other
    tokenizers read (SD3's second, a CLIP, reads 77: its T5 is the third)."""
    for family in ("flux", "sd3"):
        assert max_sequence_length(FAMILIES[family].build()) == {}
