"""Session-scoped fixtures shared by the families test modules (registered in conftest.py).

Each family's tiny build is made once per test run, into one directory for the run, and loaded from
there once by each test process: every module that needs a family's directory, its loaded pipeline or what the runner
makes of it asks these fixtures instead of building its own. Tests must not change a build's files
nor a loaded pipeline's weights or configuration (run-time arguments are fine).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from runner_service.models.table import Row

# torch, diffusers and the builders are imported when a family is first asked for: this plugin is
# loaded by every test run, the unit-only ones included.


@pytest.fixture(scope="session")
def family_root(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """Where the run's family builds are saved: a runner serving them takes it as a ``--model-root``.
    Under pytest-xdist one directory for all its workers (beside their own temporary directories, as
    conftest's model cache), which a build writes atomically (``catalog.write_atomically``): a family
    is built once per run, not once by every worker whose modules ask for it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "family-builds"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def family_directory(family_root: Path) -> Callable[[str], Path]:
    """The directory of a family's tiny build (``runner_service.families``), built on first use."""
    from runner_service.models.catalog import build_family

    def directory(name: str) -> Path:
        target = family_root / name
        if not (target / "model_index.json").exists():
            build_family(name, target)
        return target

    return directory


@pytest.fixture(scope="session")
def family_pipeline(family_directory: Callable[[str], Path]) -> Callable[[str], DiffusionPipeline]:
    """A family's tiny build loaded through ``DiffusionPipeline.from_pretrained``, once per session."""
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    loaded: dict[str, DiffusionPipeline] = {}

    def pipeline(name: str) -> DiffusionPipeline:
        if name not in loaded:
            loaded[name] = DiffusionPipeline.from_pretrained(family_directory(name))
            loaded[name].set_progress_bar_config(disable=True)
        return loaded[name]

    return pipeline


@pytest.fixture(scope="session")
def family_row(family_pipeline: Callable[[str], DiffusionPipeline]) -> Callable[[str], Row]:
    """What the runner makes of a family's loaded build (``table.row``: capabilities after the canary,
    the step-level loop), once per session."""
    from runner_service.families import FAMILIES
    from runner_service.models.table import row

    found: dict[str, Row] = {}

    def row_of(name: str) -> Row:
        if name not in found:
            found[name] = row(FAMILIES[name], family_pipeline(name))
        return found[name]

    return row_of
