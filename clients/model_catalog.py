"""``diffusion models``: the models this machine can serve, each under the name a source takes.

Three places, as the runner reads them (``runner_service.model_sources``):

- the built-in models (``tiny``, ``shapes``, ...): served by name, nothing to fetch;
- the Hugging Face hub cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``): each diffusers
  pipeline (a snapshot holding ``model_index.json``) once per branch or tag pointing at it
  (``org/name`` for ``main``, ``org/name@tag`` for another) or, detached, by its commit; with its
  size on disk and its pipeline class (its family, as diffusers names it);
- the model roots given with ``--model-root`` (the runner's flag, or ``DIFFUSION_RUNNER_MODEL_ROOT``):
  each root, and each directory in it, that holds a diffusers pipeline, by its path.

There is no RPC for this (the contract is fixed): it lists what the machine it runs on holds, so
run it where the runner runs. It needs no worker, no torch; the hub cache is read with
``huggingface_hub`` (installed with the runner), skipped with a note where it is missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from serving_common.protocol import BUILTIN_MODEL_NAMES

MODEL_INDEX = "model_index.json"


@dataclass(frozen=True)
class CatalogEntry:
    """One model: the ``name`` to give ``--model`` or Init, where it comes from, its pipeline class
    ("" unknown), its bytes on disk (None: not measured) and where it is."""

    name: str
    kind: str
    pipeline: str
    size: int | None
    path: str


def built_ins() -> list[CatalogEntry]:
    return [CatalogEntry(name, "built-in", "", None, "") for name in BUILTIN_MODEL_NAMES]


def pipeline_class(directory: Path) -> str | None:
    """The ``_class_name`` of a diffusers model directory's ``model_index.json``; None where it has
    none (not a pipeline), "" where it cannot be read."""
    index = directory / MODEL_INDEX
    if not index.is_file():
        return None
    try:
        return str(json.loads(index.read_text()).get("_class_name", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def hub_models(cache_dir: Path | None = None) -> list[CatalogEntry]:
    """The diffusers pipelines in the hub cache (``cache_dir``; None: the hub library's default)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    entries = []
    for repo in sorted(cache.repos, key=lambda repo: repo.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda revision: revision.commit_hash):
            pipeline = pipeline_class(revision.snapshot_path)
            if pipeline is None:
                continue
            for name in _names(repo.repo_id, revision.commit_hash, revision.refs):
                entries.append(CatalogEntry(name, "hugging face", pipeline, revision.size_on_disk,
                                            str(revision.snapshot_path)))
    return entries


def _names(repo_id: str, commit: str, refs: Iterable[str]) -> list[str]:
    """How a source names a snapshot: ``repo_id`` for main, ``repo_id@ref`` for each other ref,
    ``repo_id@commit`` for one no ref points at."""
    names = [repo_id if ref == "main" else f"{repo_id}@{ref}" for ref in sorted(refs)]
    return sorted(names, key=lambda name: (name != repo_id, name)) or [f"{repo_id}@{commit}"]


def root_models(roots: Sequence[Path]) -> list[CatalogEntry]:
    """Each root, and each directory in it, that holds a diffusers pipeline."""
    entries = []
    for root in roots:
        for directory in _candidates(root):
            pipeline = pipeline_class(directory)
            if pipeline is not None:
                entries.append(CatalogEntry(str(directory), "model root", pipeline, _size(directory), str(directory)))
    return entries


def _candidates(root: Path) -> Iterator[Path]:
    yield root
    try:
        yield from sorted(path for path in root.iterdir() if path.is_dir())
    except OSError:
        return


def _size(directory: Path) -> int:
    """The bytes of the files under ``directory``, each counted once (links followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _, files in os.walk(directory, followlinks=True):
        for name in files:
            try:
                status = os.stat(Path(top) / name)
            except OSError:
                continue
            if (status.st_dev, status.st_ino) not in seen:
                seen.add((status.st_dev, status.st_ino))
                total += status.st_size
    return total


def catalog(roots: Sequence[Path], cache_dir: Path | None = None) -> tuple[list[CatalogEntry], list[str]]:
    """Every model this machine holds, and notes on what could not be looked at."""
    notes = []
    try:
        hub = hub_models(cache_dir)
    except ImportError:
        hub = []
        notes.append("the Hugging Face cache was not read: huggingface_hub is not installed here (it comes with "
                     "the runner: pip install 'diffusion-serving[runner]')")
    return [*built_ins(), *hub, *root_models(roots)], notes


def human_size(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
