"""The built-in models: names the runner serves without files, so every family can be tried.

``shapes`` is trained (``train_shapes``) and ships in the package: its directory,
``runner_service/models/shapes``, is the model, loaded through ``from_pretrained`` like any other.
The others are built on first use from configs with seeded random weights: ``tiny`` and ``small``
are Stable Diffusion 1.x pipelines (``families.sd.tiny``), and the rest the tiny random builds of the
families whose registry record names a built-in (``Family.builtin``: ``tiny-sdxl``, ``tiny-sd3``,
``tiny-flux``, and the videos ``tiny-wan`` and ``tiny-wan-i2v``). Each is saved in diffusers
format into the model cache and loaded back through ``from_pretrained``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.families import FAMILIES
from runner_service.families.sd.tiny import SD_SPECS, build_sd

logger = logging.getLogger(__name__)

# The trained built-in models, each a diffusers model directory in the package.
SHIPPED_MODELS: dict[str, Path] = {"shapes": Path(__file__).with_name("shapes")}

# The built-in models built from configs with seeded random weights, by name.
BUILT_MODELS: dict[str, Callable[[], DiffusionPipeline]] = {
    **{name: partial(build_sd, name) for name in SD_SPECS},
    **{family.builtin: family.build for family in FAMILIES.values() if family.builtin},
}

BUILTIN_MODELS: tuple[str, ...] = (*SHIPPED_MODELS, *BUILT_MODELS)

# The file a complete pipeline directory holds (what ``write_atomically`` checks by default).
MODEL_INDEX = "model_index.json"


def save_builtin(name: str, output_dir: Path) -> Path:
    """Writes the named built-in model to ``output_dir`` in diffusers format, atomically: a copy of
    a shipped model's directory, or a built model."""
    what = f"built-in model {name}"
    if name in SHIPPED_MODELS:
        return write_atomically(partial(shutil.copytree, SHIPPED_MODELS[name], dirs_exist_ok=True), output_dir, what)
    if name not in BUILT_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {sorted(BUILTIN_MODELS)}")
    return save_pipeline_atomically(BUILT_MODELS[name], output_dir, what)


def ensure_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Returns the directory of the named built-in model: a shipped model's own, or the cache's,
    where a built model is built on first use."""
    if name in SHIPPED_MODELS:
        return SHIPPED_MODELS[name]
    target = (cache_dir or default_cache_dir()) / name
    if not (target / MODEL_INDEX).exists():
        logger.info("building built-in model %s into %s", name, target)
        save_builtin(name, target)
    return target


def build_family(name: str, directory: Path) -> Path:
    """Builds the named family's tiny pipeline and saves it to ``directory`` in diffusers format, atomically."""
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; choose from {sorted(FAMILIES)}")
    return save_pipeline_atomically(FAMILIES[name].build, directory, f"model family {name}")


def save_pipeline_atomically(build: Callable[[], DiffusionPipeline], output_dir: Path, what: str) -> Path:
    """Builds a pipeline and writes it to ``output_dir`` in diffusers format (see ``write_atomically``)."""
    return write_atomically(lambda staging: build().save_pretrained(staging, safe_serialization=True), output_dir,
                            what)


def write_atomically(write: Callable[[Path], object], output_dir: Path, what: str,
                     complete: Sequence[str] = (MODEL_INDEX,)) -> Path:
    """Writes a model directory: ``write`` fills a temporary sibling of ``output_dir``, which is then
    renamed into place, so a crash or a concurrent writer never leaves a half-written model. Where
    the rename fails because another writer got there first, ``output_dir`` is taken as written when
    it holds every path of ``complete``: its kind's files (a pipeline's model_index.json; a
    ControlNet's config and weights; an IP-Adapter's weights and image encoder), else the error stands."""
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        write(staging)
        try:
            staging.rename(output_dir)
        except OSError:
            if not all((output_dir / path).exists() for path in complete):
                raise
            logger.info("%s already written to %s by another process", what, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def default_cache_dir() -> Path:
    """Where built-in models are cached: ``$DIFFUSION_MODEL_CACHE`` or ``~/.cache``."""
    configured = os.environ.get("DIFFUSION_MODEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diffusion-serving" / "models"
