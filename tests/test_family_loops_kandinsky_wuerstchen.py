"""What the shared loop test (``test_family_loops``, whose sequences differ in size, so never
share a call) leaves out for Kandinsky 3 and Würstchen: sequences of one size sharing denoiser
calls, Kandinsky 3's prompts of different lengths padded into one UNet call, and Würstchen's
prior and decoder phases in one step, each phase's sequences in one call of its own denoiser.
Each image equals the pipeline's own ``__call__`` (through the adapter) within 1/255."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from runner_service.denoising.loop import Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import FAMILIES, loop_for
from runner_service.pipeline_adapter import ImageRows, adapt
from serving_common.generation_params import GenerationParams

pytestmark = pytest.mark.process

CPU = torch.device("cpu")


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


@contextmanager
def calls(modules: dict[str, torch.nn.Module], log: list[tuple[str, int]]) -> Iterator[None]:
    """Logs each forward of the named modules with its rows."""
    handles = [module.register_forward_hook(lambda _, args, __, name=name: log.append((name, args[0].shape[0])))
               for name, module in modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def assert_each_as_its_own_call(name: str, pipeline, sequences: list[Sequence], images: np.ndarray) -> None:
    adapter = adapt(pipeline)
    for sequence, image in zip(sequences, images, strict=True):
        spec = sequence.spec
        with torch.inference_mode():
            own = adapter.generate(ImageRows.of(spec.prompt, spec.negative_prompt, [spec.seed]),
                                   GenerationParams(width=spec.width, height=spec.height,
                                                    num_inference_steps=spec.steps, guidance_scale=spec.guidance),
                                   lambda done, total: None)[0]
        difference = int(np.abs(uint8(image).astype(int) - uint8(own).astype(int)).max())
        assert difference <= 1, f"{name}: seed {spec.seed} differs by {difference}/255 from __call__"


def test_kandinsky3_prompts_of_different_lengths_share_a_unet_call_each_as_its_own_call():
    pipeline = FAMILIES["kandinsky3"].build()
    pipeline.set_progress_bar_config(disable=True)
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    log: list[tuple[str, int]] = []
    cache = PromptCache()
    with torch.inference_mode(), calls({"unet": pipeline.unet}, log):
        sequences = [loop.start(SequenceSpec("a red circle on a blue square beside a yellow star", "blurry", 64, 64,
                                             3, 3.0, 11, ()), cache, "v"),
                     loop.start(SequenceSpec("a dot", "", 64, 64, 3, 1.0, 12, ()), cache, "v")]
        lengths = {s.conditioning["encoder_hidden_states"].shape[1] for s in sequences}
        assert len(lengths) == 2, "the prompts encode to different lengths"
        while not all(s.finished for s in sequences):
            loop.step(sequences)
        images = loop.decode(sequences).numpy()
    assert log == [("unet", 3)] * 3  # guided (two rows) and unguided in one call a step
    assert_each_as_its_own_call("kandinsky3", pipeline, sequences, images)


def test_wuerstchen_prior_and_decoder_phases_in_one_step_each_as_its_own_call():
    pipeline = FAMILIES["wuerstchen"].build()
    pipeline.set_progress_bar_config(disable=True)
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    log: list[tuple[str, int]] = []
    steps: list[list[tuple[str, int]]] = []
    cache = PromptCache()
    with torch.inference_mode(), calls({"prior": pipeline.prior_prior, "decoder": pipeline.decoder}, log):
        guided = loop.start(SequenceSpec("a red circle on blue", "blurry", 128, 128, 3, 4.0, 11, ()), cache, "v")
        sequences = [guided]
        for step in range(6):
            if step == 2:  # joins for the guided one's last prior step
                sequences.append(loop.start(SequenceSpec("a green square", "", 128, 128, 2, 1.0, 12, ()), cache, "v"))
            loop.step(sequences)
            steps.append(sorted(log))
            log.clear()
        assert all(s.finished for s in sequences)
        images = loop.decode(sequences).numpy()
    assert [s.total for s in sequences] == [6, 4]  # the prior's steps and the decoder's
    assert steps == [[("prior", 2)], [("prior", 2)], [("prior", 3)],
                     [("decoder", 1), ("prior", 1)],  # one in its prior phase, one in its decoder phase
                     [("decoder", 2)], [("decoder", 2)]]
    assert_each_as_its_own_call("wuerstchen", pipeline, sequences, images)
