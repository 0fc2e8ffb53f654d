"""Images leave the device as uint8 (issue 40 item 4): the conversion on the device gives exactly the
bytes of the host conversion it replaced (``(x * 255).round().clip(0, 255).astype(np.uint8)`` on
diffusers' float32 numpy output), ties and out-of-range values included, from float32 and float16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.device_output import as_pixels
from runner_service.families import loop_for
from runner_service.models.catalog import ensure_builtin
from runner_service.platforms.cpu import CpuPlatform
from runner_service.step_engine import decode_finished

pytestmark = pytest.mark.unit


def host_conversion(images: torch.Tensor) -> np.ndarray:
    """The path before: diffusers' ``pt_to_numpy`` (``.cpu().float().numpy()``), then the runner's numpy rounding."""
    floats = images.cpu().float().numpy()
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_device_conversion_gives_the_host_conversions_bytes(dtype: torch.dtype) -> None:
    ties = (torch.arange(256, dtype=torch.float32) + 0.5) / 255  # x * 255 lands on or next to k + 0.5
    ramp = torch.linspace(-0.1, 1.1, 4099)
    noise = torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(0))
    for values in (ties, ramp, noise):
        images = values.to(dtype)
        converted = as_pixels(images)
        assert converted.dtype == torch.uint8
        assert np.array_equal(converted.numpy(), host_conversion(images))


def test_the_step_loop_sends_the_bytes_of_the_old_path() -> None:
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin("tiny"), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    loop = loop_for(pipeline, torch.device("cpu"))
    assert loop is not None
    with torch.inference_mode():
        sequences = [loop.start(SequenceSpec(prompt, "", 64, 64, 2, 4.0, seed, ()), PromptCache(0), "")
                     for seed, prompt in enumerate(["a red circle", "a blue square"])]
        while not all(s.finished for s in sequences):
            loop.step(sequences)
        decoded = loop.decode(sequences)
        pixels = decode_finished(loop, sequences, to_host=CpuPlatform().to_host)
    old = host_conversion(decoded)
    for sequence, expected in zip(sequences, old, strict=True):
        assert pixels[id(sequence)].dtype == np.uint8
        assert np.array_equal(pixels[id(sequence)], expected)
