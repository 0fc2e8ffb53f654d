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
from runner_service.models import table
from runner_service.models.families import FAMILIES

# Builds and runs models in this process. No timeout of its own: the table test canaries every family,
# which took over 60 s on a loaded machine; the suite's 300 s guard against hangs applies.
pytestmark = [pytest.mark.process, pytest.mark.slow]


def generate(pipeline: DiffusionPipeline, size: int) -> np.ndarray:
    """One step at ``size`` x ``size``, with the knobs some families need to give exactly that size quickly
    (and a grey image to edit for an edit family)."""
    parameters = inspect.signature(pipeline.__call__).parameters
    arguments = {"use_resolution_binning": False, "prior_num_inference_steps": 1,
                 "image": Image.new("RGB", (size, size), (128, 128, 128))}
    return pipeline(
        prompt="a red fox in the snow",
        height=size,
        width=size,
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **{key: value for key, value in arguments.items() if key in parameters},
    ).images


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


def test_the_families_table_is_what_the_runner_finds(family_row: Callable[[str], table.Row]) -> None:
    document = (REPO / table.DOCUMENT).read_text()
    assert table.replaced(document, table.render([family_row(name) for name in FAMILIES])) == document, (
        f"run python -m runner_service.models.table --write {table.DOCUMENT}")
