"""The benchmarks' requests are not shaped to flatter one of our features, and bench_shapes tells a batch's
rounding from a changed reading."""

from __future__ import annotations

import random

import pytest

from benchmarks.bench import PROMPT, prompt_for

pytestmark = pytest.mark.unit


def test_every_request_has_its_own_prompt_by_default() -> None:
    prompts = [prompt_for(index) for index in range(1000)]
    assert len(set(prompts)) == len(prompts)
    assert PROMPT not in prompts


def test_the_prompt_repeat_repeats_that_share_of_prompts_the_same_for_every_caller() -> None:
    prompts = [prompt_for(index, repeat=0.25) for index in range(4000)]
    repeated = prompts.count(PROMPT)
    assert 800 < repeated < 1200
    assert prompts == [prompt_for(index, repeat=0.25) for index in range(4000)]
    assert len(set(prompts)) == len(prompts) - repeated + 1


def test_bench_shapes_compares_each_served_image_with_its_in_process_reading() -> None:
    from benchmarks.bench_shapes import against_reference, missed, shares
    from runner_service.models.shapes_scenes import Scene, draw

    scenes = [Scene("red", "circle", "blue", "on the left"), Scene("yellow", "square", "black", "at the top")]
    reference = [draw(scene, 64, 64, random.Random(index)) for index, scene in enumerate(scenes)]
    rounded = [image.copy() for image in reference]
    rounded[0][0, 0, 0] += 1  # a batch's rounding: the same reading
    swapped = [reference[1], reference[0]]  # a batch that swapped its rows' prompts

    assert against_reference(reference, rounded) == {
        "readings_differing": 0, "differing_images": [], "max_pixel_difference": 1}
    assert against_reference(reference, swapped)["differing_images"] == [0, 1]
    results = {"in_process": {"shares": shares(scenes, reference)}, "step": {"shares": shares(scenes, rounded)},
               "request": {"shares": shares(scenes, swapped)}}
    assert results["in_process"]["shares"] == dict.fromkeys(("colour", "background", "shape", "position"), 1.0)
    assert missed(results) == [
        "request colour 0.0% < 95%", "request colour 0.0% below in-process 100.0%",
        "request background 0.0% < 95%", "request background 0.0% below in-process 100.0%",
        "request shape 0.0% < 85%", "request shape 0.0% below in-process 100.0%",
        "request position 0.0% < 90%", "request position 0.0% below in-process 100.0%",
    ]
