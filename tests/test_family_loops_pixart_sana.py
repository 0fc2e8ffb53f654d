"""What the PixArt and Sana ``__call__``s do that the shared loop test (``test_family_loops``)
cannot reach with the tiny builds in float32: PixArt-alpha's 1024-pixel model (``sample_size`` 128)
conditioned on each image's resolution and aspect ratio, and its single step that returns the
predicted original sample (the tiny build's DDIM ends at alpha 1, where both outputs are the same:
here it does not; DPM-Solver's step gives none); Sana's float32 latents under a bfloat16 model.
Each image of the loop equals ``__call__``'s through the pipeline adapter within 1/255."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, PixArtTransformer2DModel

from runner_service.denoising.loop import SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import FAMILIES, loop_for
from runner_service.pipeline_adapter import ImageRows, adapt
from runner_service.step_engine import decode_finished
from serving_common.generation_params import GenerationParams

pytestmark = pytest.mark.process

CPU = torch.device("cpu")


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


def assert_loop_equals_call(pipeline, specs: list[SequenceSpec]) -> None:
    """The specs stepped together through the family's loop, each image against ``__call__``'s."""
    adapter = adapt(pipeline)
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    with torch.inference_mode():
        sequences = [loop.start(spec, PromptCache(), "v") for spec in specs]
        while not all(sequence.finished for sequence in sequences):
            loop.step(sequences)
        decoded = decode_finished(loop, sequences)
        for spec, sequence in zip(specs, sequences, strict=True):
            own = uint8(adapter.generate(ImageRows.of(spec.prompt, spec.negative_prompt, [spec.seed]),
                                         GenerationParams(width=spec.width, height=spec.height,
                                                          num_inference_steps=spec.steps, guidance_scale=spec.guidance),
                                         lambda done, total: None))[0]
            difference = int(np.abs(decoded[id(sequence)].astype(int) - own.astype(int)).max())
            assert difference <= 1, f"seed {spec.seed} differs by {difference}/255 from __call__"


def test_pixart_alpha_conditions_a_1024_pixel_model_on_each_images_size():
    pipeline = FAMILIES["pixart-alpha"].build()
    pipeline.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    pipeline.transformer = PixArtTransformer2DModel.from_config({**pipeline.transformer.config, "sample_size": 128})
    assert pipeline.transformer.use_additional_conditions
    assert_loop_equals_call(pipeline, [SequenceSpec("a red circle", "blurry", 16, 16, 3, 4.5, 1, ()),
                                       SequenceSpec("a green square", "", 24, 16, 3, 1.0, 2, ())])


def test_pixart_alpha_takes_a_single_steps_predicted_original_sample():
    pipeline = FAMILIES["pixart-alpha"].build()
    pipeline.set_progress_bar_config(disable=True)
    pipeline.scheduler = DDIMScheduler(set_alpha_to_one=False)
    assert_loop_equals_call(pipeline, [SequenceSpec("a red circle", "blurry", 16, 16, 1, 4.5, 1, ()),
                                       SequenceSpec("a green square", "", 16, 16, 2, 1.0, 2, ())])


def test_pixart_alpha_steps_once_with_a_scheduler_whose_step_gives_no_original_sample():
    """DPM-Solver's step gives none (``__call__`` fails at one step): the one-step canary at load
    must still pass for the loop to serve the model's other requests."""
    pipeline = FAMILIES["pixart-alpha"].build()
    pipeline.scheduler = DPMSolverMultistepScheduler()
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    with torch.inference_mode():
        sequence = loop.start(SequenceSpec("canary", "", 8, 8, 1, 2.0, 0, ()), PromptCache(0), "")
        loop.step([sequence])
        assert loop.decode([sequence]).shape == (1, 8, 8, 3)


def test_sana_keeps_its_latents_in_float32_under_a_bfloat16_model():
    pipeline = FAMILIES["sana"].build().to(torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    assert_loop_equals_call(pipeline, [SequenceSpec("a red circle", "blurry", 32, 32, 3, 4.5, 1, ()),
                                       SequenceSpec("a green square", "", 64, 32, 2, 1.0, 2, ())])
