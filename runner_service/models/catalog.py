"""The built-in models: names the runner builds on first use, so every family can be tried without files.

``tiny`` and ``small`` are Stable Diffusion 1.x pipelines (``builtin``); the others are the tiny
random builds of the families whose registry record names a built-in (``Family.builtin``:
``tiny-sdxl``, ``tiny-sd3``, ``tiny-flux``). Each is built from configs with seeded random weights,
saved in diffusers format into the model cache and loaded back through ``from_pretrained`` like any
other model directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.models.builtin import SD_SPECS, build_pipeline, default_cache_dir, save_pipeline_atomically
from runner_service.models.families import FAMILIES

logger = logging.getLogger(__name__)

BUILTIN_MODELS: dict[str, Callable[[], DiffusionPipeline]] = {
    **{name: partial(build_pipeline, name) for name in SD_SPECS},
    **{family.builtin: family.build for family in FAMILIES.values() if family.builtin},
}


def save_builtin(name: str, output_dir: Path) -> Path:
    """Writes the named built-in model to ``output_dir`` in diffusers format, atomically."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {sorted(BUILTIN_MODELS)}")
    return save_pipeline_atomically(BUILTIN_MODELS[name], output_dir, f"built-in model {name}")


def ensure_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Returns the directory of the named built-in model, building it on first use."""
    target = (cache_dir or default_cache_dir()) / name
    if not (target / "model_index.json").exists():
        logger.info("building built-in model %s into %s", name, target)
        save_builtin(name, target)
    return target
