"""Every family's step-level loop, in process, against the pipeline's own ``__call__``: a guided
sequence runs alone for three steps, then an unguided one with another prompt, seed, step count
and size (wider by one grid step: its own size group in the same steps) joins it, and each image
equals the one ``__call__`` makes for it alone (through the pipeline adapter, which passes what
the runner passes) within 1/255. The families' tiny builds (``runner_service.families``)
are built in memory; served step batching is tested in ``test_step_batching`` and
``test_families``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.families import FAMILIES, TEXT_TO_IMAGE, loop_for
from runner_service.pipeline_adapter import ImageRows, PipelineAdapter, adapt
from runner_service.step_engine import decode_finished
from serving_common.generation_params import GenerationParams

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
STEPS = 6
JOINING_STEPS = 3  # it joins after step 3 of 6: both finish at the same step, and are decoded together
JOIN_AT = 3
STEPPED = [name for name in TEXT_TO_IMAGE if FAMILIES[name].loop is not None]


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


def test_every_image_family_has_a_step_loop():
    assert all(family.loop is not None for family in FAMILIES.values() if family.video is None)


@pytest.fixture(scope="module", params=STEPPED)
def family(request) -> tuple[str, DiffusionPipeline, PipelineAdapter]:
    """A family's build and its adapter, made once for the family's tests: ``adapt`` dry-runs every
    scheduler it offers, which costs more than the build's steps here."""
    pipeline = FAMILIES[request.param].build()
    pipeline.set_progress_bar_config(disable=True)
    return request.param, pipeline, adapt(pipeline)


def test_a_sequence_joining_at_step_3_equals_the_pipelines_own_call(family):
    name, pipeline, adapter = family
    capabilities = adapter.capabilities
    size = -(-max(capabilities.min_size, 16) // capabilities.size_multiple) * capabilities.size_multiple
    # The guided one with the model's own guidance (and true CFG where separate, above 1); the
    # joining one unguided (guidance 1), as a request asking for none.
    guided_scale = max(capabilities.default_guidance, 2.0)
    true_cfg = 2.0 if capabilities.separate_true_cfg else 0.0
    guided = SequenceSpec("a red circle on blue", "blurry", size, size, STEPS, guided_scale, 11, (), true_cfg)
    wider = size + capabilities.size_multiple
    joining = SequenceSpec("a green square", "", wider, size, JOINING_STEPS, 1.0, 12, ())

    def own(spec: SequenceSpec) -> np.ndarray:
        with torch.inference_mode():
            return uint8(adapter.generate(
                ImageRows.of(spec.prompt, spec.negative_prompt, [spec.seed]),
                GenerationParams(width=spec.width, height=spec.height, num_inference_steps=spec.steps,
                                 guidance_scale=spec.guidance,
                                 true_cfg_scale=spec.true_cfg if capabilities.separate_true_cfg else None),
                lambda done, total: None))[0]

    loop = loop_for(pipeline, CPU)
    assert loop is not None, f"{name} has no step-level loop"
    cache = PromptCache()
    with torch.inference_mode():
        first = loop.start(guided, cache, "v")
        for _ in range(JOIN_AT):
            loop.step([first])
        second = loop.start(joining, cache, "v")
        while not (first.finished and second.finished):
            loop.step([first, second])
        decoded = decode_finished(loop, [first, second])  # as the step engine decodes what finished in a step
        served = [decoded[id(first)], decoded[id(second)]]
    for spec, image in zip((guided, joining), served, strict=True):
        difference = int(np.abs(image.astype(int) - own(spec).astype(int)).max())
        assert difference <= 1, f"{name}: seed {spec.seed} differs by {difference}/255 from __call__"


# The most steps each family's tiny build reports (dry runs of its schedulers at load): Stable
# Diffusion's DDIM and Kandinsky 3's DDPM schedules are offset by one, so at 1000 steps they start
# at timestep 1000, past the training ones; Würstchen's ratios have no training timesteps to count
# (no limit of its own); the others run one step per training timestep.
MOST_STEPS = {"sd": 999, "kandinsky3": 999, "wuerstchen": 0}


def test_the_most_steps_reported_are_the_most_the_pipelines_own_call_runs(family):
    """One step more than a limit below the training timesteps fails in diffusers' own call, at its
    first step (``tests/test_step_failures.py`` runs ``tiny`` at its 999 through a worker)."""
    name, pipeline, adapter = family
    capabilities = adapter.capabilities
    assert capabilities.max_steps == MOST_STEPS.get(name, 1000), name
    if 0 < capabilities.max_steps < 1000:
        size = -(-max(capabilities.min_size, 16) // capabilities.size_multiple) * capabilities.size_multiple
        with torch.inference_mode(), pytest.raises(IndexError, match="index 1000 is out of bounds"):
            pipeline(prompt="a red fox", num_inference_steps=capabilities.max_steps + 1, width=size, height=size,
                     output_type="np")


def test_with_size_turns_the_smaller_group_steps_more_often_and_each_image_is_unchanged():
    """``--step-schedule budget``: a 24x24 image beside a 48x48 one (four times its cost) takes four
    steps for each of the large one's, and both still equal the images they get alone."""
    pipeline = FAMILIES["sd"].build()
    pipeline.set_progress_bar_config(disable=True)
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    small, large = (SequenceSpec("a red fox", "", size, size, 8, 1.0, seed, ()) for size, seed in ((24, 1), (48, 2)))
    cache, turns = PromptCache(), SizeTurns()
    with torch.inference_mode():
        together = [loop.start(spec, cache, "v") for spec in (small, large)]
        loop.step(together, None, turns)
        loop.step(together, None, turns)
        assert [sequence.done for sequence in together] == [2, 0]
        while not all(sequence.finished for sequence in together):
            loop.step(together, None, turns)
        decoded = decode_finished(loop, together)
        for spec, sequence in zip((small, large), together, strict=True):
            alone = loop.start(spec, cache, "v")
            while not alone.finished:
                loop.step([alone])
            difference = np.abs(decoded[id(sequence)].astype(int) - decode_finished(loop, [alone])[id(alone)]).max()
            assert difference <= 1, spec.width
