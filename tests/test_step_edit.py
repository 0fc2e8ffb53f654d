"""The edit model (InstructPix2Pix) step-level, in process: a guided edit (the call's default
guidance, a negative prompt: three rows) runs alone for three steps, then an unguided edit of
another instruction, image, seed, step count and a wider size joins it, and each image equals the
one the pipeline's own ``__call__`` (through the pipeline adapter, with the image as the runner
passes it) makes for it alone within 1/255. Served, ``test_families`` runs the edits through the
step engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from runner_service.denoising.loop import ImageSource, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import FAMILIES, loop_for
from runner_service.pipeline_adapter import ImageInputs, ImageRows, adapt
from runner_service.step_engine import decode_finished
from serving_common.generation_params import GenerationParams
from tests.test_step_image_tasks import picture, uint8

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
JOIN_AT = 3


@pytest.fixture(scope="module")
def edit_model():
    pipeline = FAMILIES["instruct-pix2pix"].build()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, adapt(pipeline).canary()


def test_an_edit_joining_a_guided_edit_at_step_3_equals_the_pipelines_own_call(edit_model):
    pipeline, adapter = edit_model
    capabilities = adapter.capabilities
    assert capabilities.tasks == ("EDIT",)
    loop = loop_for(pipeline, CPU)
    assert loop is not None and "EDIT" in loop.tasks
    size, grid = capabilities.min_size, capabilities.size_multiple
    wide = picture(size + grid).resize((size + grid, size))
    guided = SequenceSpec("make it red", "blurry", size, size, 6, capabilities.default_guidance, 11, (),
                          source=ImageSource("EDIT", adapter.pipeline, picture(size), 1.0))
    unguided = SequenceSpec("add a hat", "", size + grid, size, 4, 1.0, 12, (),
                            source=ImageSource("EDIT", adapter.pipeline, wide, 1.0))

    def own(spec: SequenceSpec, image: Image.Image) -> np.ndarray:
        with torch.inference_mode():
            return uint8(adapter.generate(
                ImageRows.of(spec.prompt, spec.negative_prompt, [spec.seed]),
                GenerationParams(width=spec.width, height=spec.height, num_inference_steps=spec.steps,
                                 guidance_scale=spec.guidance),
                lambda done, total: None, ImageInputs([image])))[0]

    cache = PromptCache()
    with torch.inference_mode():
        first = loop.start(guided, cache, "v")
        assert first.guided and first.conditioning["encoder_hidden_states"].shape[0] == 3
        for _ in range(JOIN_AT):
            loop.step([first])
        second = loop.start(unguided, cache, "v")
        assert not second.guided
        while not (first.finished and second.finished):
            loop.step([first, second])
        decoded = decode_finished(loop, [first, second])
    for label, spec in [("guided", guided), ("unguided", unguided)]:
        sequence = first if spec is guided else second
        assert spec.source is not None
        difference = int(np.abs(decoded[id(sequence)].astype(int) - own(spec, spec.source.image).astype(int)).max())
        assert difference <= 1, f"{label} edit differs by {difference}/255 from __call__"


def test_an_edit_needs_its_image(edit_model):
    pipeline, _ = edit_model
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    with pytest.raises(ValueError, match="input image"):
        loop.start(SequenceSpec("make it red", "", 24, 24, 2, 7.5, 0, ()), PromptCache(), "v")
