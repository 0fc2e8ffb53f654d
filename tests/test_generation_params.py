"""GenerationParams, the one declaration of a request's parameters: what crosses to the runner
comes back typed, and the batch key keeps apart what one pipeline call cannot share."""

from __future__ import annotations

import pytest

from diffusion.v1 import runner_pb2
from serving_common.generation_params import Control, GenerationParams, ImagePrompt

pytestmark = pytest.mark.unit


def raw(width: int) -> runner_pb2.RawImage:
    return runner_pb2.RawImage(pixels=bytes(width * 2 * 3), width=width, height=2, channels=3)


def test_controls_and_an_image_prompt_cross_to_the_runner_and_back() -> None:
    params = GenerationParams(prompt="a fox", width=64, height=64, num_inference_steps=4,
                              controls=(Control("edges", 0.5, 0.25, 0.75), Control("depth")),
                              ip_adapter=ImagePrompt("style", 0.5, images=2))
    item = params.to_item("r1", control_images=[raw(4), raw(5)], prompt_images=[raw(6), raw(7)])
    assert [control.image.width for control in item.controls] == [4, 5]
    assert [image.width for image in item.ip_adapter.images] == [6, 7]
    assert GenerationParams.from_item(item) == params  # the scales are exact in float32
    assert GenerationParams.from_item(GenerationParams(prompt="plain").to_item("r2")).ip_adapter is None


def test_image_prompts_of_another_image_count_never_share_a_batch() -> None:
    """The adapter attends over all of a request's reference images at once: one pipeline call takes
    one count, so the worker must not batch a one-image prompt with a two-image one."""
    one = GenerationParams(ip_adapter=ImagePrompt("style", 1.0, images=1))
    two = GenerationParams(ip_adapter=ImagePrompt("style", 1.0, images=2))
    assert one.batch_key() != two.batch_key()
    assert one.differences(two) == ["ip_adapter"]
    assert one.batch_key() == GenerationParams(ip_adapter=ImagePrompt("style", 1.0, images=1)).batch_key()
