"""Every tiny model family builds offline, loads through ``from_pretrained`` and generates its smallest size."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from harness.processes import REPO
from runner_service.models import table
from runner_service.models.families import FAMILIES, SMALLEST_SIZE, build_family
from runner_service.pipeline_adapter import adapt

# No timeout of its own: the README table test builds and canaries all 13 families in one test,
# which took over 60 s on a loaded machine; the suite's 300 s guard against hangs applies.


def generate(pipeline: DiffusionPipeline, size: int) -> np.ndarray:
    """One step at ``size`` x ``size``, with the knobs some families need to give exactly that size quickly."""
    parameters = inspect.signature(pipeline.__call__).parameters
    arguments = {"use_resolution_binning": False, "prior_num_inference_steps": 1}
    return pipeline(
        prompt="a red fox in the snow",
        height=size,
        width=size,
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **{key: value for key, value in arguments.items() if key in parameters},
    ).images


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_builds_loads_and_generates_exactly_its_smallest_size(name, tmp_path):
    assert set(SMALLEST_SIZE) == set(FAMILIES)
    directory = build_family(name, tmp_path / name)
    assert (directory / "model_index.json").is_file()
    pipeline = DiffusionPipeline.from_pretrained(directory)
    pipeline.set_progress_bar_config(disable=True)
    size = SMALLEST_SIZE[name]
    first = generate(pipeline, size)
    assert first.shape == (1, size, size, 3)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(generate(pipeline, size), first)


def test_the_readme_families_table_is_what_the_adapter_finds():
    assert table.main(["--check", str(REPO / "README.md")]) == 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_adapter_finds_the_smallest_size_found_by_trying(name):
    assert adapt(FAMILIES[name]()).capabilities.min_size == SMALLEST_SIZE[name]
