"""The family registry: every diffusers family the runner knows by name, each in a folder of its own.

A family's folder, ``runner_service/families/<name>/``, holds all that is particular to it:
``__init__.py`` its record, ``FAMILY`` (a ``record.Family``: its pipeline class, its call quirks,
its size rounding, its video grid, its latent preview map, its CFG layout for parallel CFG),
``tiny.py`` its tiny random build and ``loop.py`` its step-level denoising loop, where it has one.
Families whose pipelines are alike import from a sibling (SDXL's loop from SD's, PixArt-alpha's from
PixArt-Sigma's). What every loop shares is ``runner_service.denoising.loop``, which knows no family.

Each tiny build makes a complete diffusers pipeline from configs with seeded random weights
(``seeded``): the tiny component configs of diffusers' own pipeline tests
(``tests/pipelines/<family>/test_*.py``, ``get_dummy_components()``), with every tokenizer and text
encoder those tests fetch from the hub (``hf-internal-testing/...``) replaced by one built in memory
(``text_models``). Nothing is downloaded, and the same name gives the same bytes on every build.
Where a test config would not give the requested image size, or would make a saved model larger
than a few MB, the config is changed; the family's quirks say why.

The pipeline adapter, the step engine (through ``loop_for``), parallel CFG, the built-in catalog,
the families table of ``docs/families.md`` (``models.table``) and the tests read the records from
here. Adding a family is one folder, named in ``_PACKAGES`` (in the order of the families table;
a test fails for a folder left out).
"""

from __future__ import annotations

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import DenoisingLoop
from runner_service.families import (
    cogview4,
    flux,
    hunyuan_dit,
    instruct_pix2pix,
    kandinsky3,
    ltx,
    lumina2,
    pixart_alpha,
    pixart_sigma,
    qwen_image,
    sana,
    sd,
    sd3,
    sdxl,
    wan,
    wan_i2v,
    wuerstchen,
)
from runner_service.families.record import Family
from runner_service.previews import LatentPreview

# The family packages, in the order of the families table.
_PACKAGES = (sd, sdxl, sd3, flux, pixart_alpha, pixart_sigma, sana, lumina2, cogview4, qwen_image, hunyuan_dit,
             kandinsky3, wuerstchen, instruct_pix2pix, wan, wan_i2v, ltx)

FAMILIES: dict[str, Family] = {package.FAMILY.name: package.FAMILY for package in _PACKAGES}
# The families whose pipeline makes an image from text alone.
TEXT_TO_IMAGE: tuple[str, ...] = tuple(
    name for name, family in FAMILIES.items() if not family.edit and family.video is None
)
# The families whose pipeline makes videos.
VIDEO: tuple[str, ...] = tuple(name for name, family in FAMILIES.items() if family.video is not None)
_BY_PIPELINE_CLASS = {family.pipeline_class: family for family in FAMILIES.values()}


def family_of(pipeline: DiffusionPipeline) -> Family | None:
    """The family of a loaded pipeline, by the exact name of its class; None for one not declared here."""
    return _BY_PIPELINE_CLASS.get(type(pipeline).__name__)


def latent_preview(pipeline: DiffusionPipeline) -> LatentPreview | None:
    """The preview map of a loaded pipeline's family; None where it declares none."""
    family = family_of(pipeline)
    return family.preview if family is not None else None


def loop_for(pipeline: DiffusionPipeline, device: torch.device) -> DenoisingLoop | None:
    """The step-level loop of the pipeline's family, where it serves this pipeline, or None
    (request-level batching)."""
    family = family_of(pipeline)
    if family is None or family.loop is None or not family.loop.serves(pipeline):
        return None
    return family.loop(pipeline, device)
