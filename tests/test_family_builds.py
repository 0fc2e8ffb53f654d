"""Every registered model family's tiny build: offline, through ``from_pretrained``, as its record says.

Each family is built and loaded once per test run (``fixtures_families``); these tests check the
build against its registry record (pipeline class, smallest size, step-level loop) and the
families table of ``docs/families.md`` against what the runner makes of every build.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from harness.processes import REPO
from runner_service.families import FAMILIES, VIDEO
from runner_service.models import table

# Builds and runs models in this process. No timeout of its own: the table test canaries every family,
# which took over 60 s on a loaded machine; the suite's 300 s guard against hangs applies.
pytestmark = [pytest.mark.process, pytest.mark.slow]


def generate(pipeline: DiffusionPipeline, width: int, height: int | None = None, frames: int = 1) -> np.ndarray:
    """One step at ``width`` x ``height`` (square by default), with the knobs some families need to give
    exactly that size quickly (and a grey image to edit, or to start a video from): images as
    (images, H, W, 3); a video family's ``frames`` frames (the fewest by default) as (frames, H, W, 3)."""
    height = height or width
    parameters = inspect.signature(pipeline.__call__).parameters
    arguments = {"use_resolution_binning": False, "prior_num_inference_steps": 1, "num_frames": frames,
                 "image": Image.new("RGB", (width, height), (128, 128, 128))}
    output = pipeline(
        prompt="a red fox in the snow",
        height=height,
        width=width,
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **{key: value for key, value in arguments.items() if key in parameters},
    )
    return output.frames[0] if "num_frames" in parameters else output.images


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_builds_loads_and_generates_exactly_its_smallest_size(
        name: str, family_pipeline: Callable[[str], DiffusionPipeline]) -> None:
    family = FAMILIES[name]
    pipeline = family_pipeline(name)
    assert type(pipeline).__name__ == family.pipeline_class
    first = generate(pipeline, family.smallest_size)
    assert first.shape == (1, family.smallest_size, family.smallest_size, 3)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(generate(pipeline, family.smallest_size), first)


@pytest.mark.parametrize("name", VIDEO)
def test_a_video_familys_grid_is_where_its_pipeline_stops(
        name: str, family_pipeline: Callable[[str], DiffusionPipeline]) -> None:
    """The frame counts and sizes its record's grid reads from the configs generate; a size off its
    multiple is refused, and one grid step past a limit the model has fails in the pipeline: the grid
    is the model's, not a guess."""
    family = FAMILIES[name]
    assert family.video is not None
    pipeline = family_pipeline(name)
    grid = family.video.grid(pipeline)
    smallest = family.smallest_size
    assert grid.frame_step > 1 and smallest % grid.size_multiple == 0
    frames = grid.max_frames or 4 * grid.frame_step + 1
    assert (frames - 1) % grid.frame_step == 0
    assert generate(pipeline, smallest, frames=frames).shape == (frames, smallest, smallest, 3)
    with pytest.raises(ValueError):
        generate(pipeline, smallest + grid.size_multiple // 2)
    if grid.max_frames:
        with pytest.raises(RuntimeError):
            generate(pipeline, smallest, frames=grid.max_frames + grid.frame_step)
    if grid.max_size:
        assert generate(pipeline, grid.max_size, smallest).shape == (1, smallest, grid.max_size, 3)
        with pytest.raises(RuntimeError):
            generate(pipeline, grid.max_size + grid.size_multiple, smallest)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_runner_finds_the_smallest_size_and_the_loop_its_record_declares(
        name: str, family_row: Callable[[str], table.Row]) -> None:
    family, found = FAMILIES[name], family_row(name)
    assert found.pipeline_class == family.pipeline_class
    assert found.capabilities.min_size == family.smallest_size
    assert found.loop == (family.loop.__name__ if family.loop else "")
    if family.rounds_to:
        assert found.capabilities.size_multiple == family.rounds_to
    assert ("EDIT" in found.capabilities.tasks) == family.edit
    assert (found.video is not None) == (family.video is not None)
    if found.video is not None:  # the sizes its record's grid reads from the configs, and one video task
        assert found.capabilities.size_multiple == found.video.size_multiple
        assert found.capabilities.max_size == found.video.max_size
        assert found.capabilities.tasks in (("TEXT_TO_VIDEO",), ("IMAGE_TO_VIDEO",))


def test_the_families_table_is_what_the_runner_finds(family_row: Callable[[str], table.Row]) -> None:
    document = (REPO / table.DOCUMENT).read_text()
    assert table.replaced(document, table.render([family_row(name) for name in FAMILIES])) == document, (
        f"run python -m runner_service.models.table --write {table.DOCUMENT}")
