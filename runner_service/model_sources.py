"""What a model source string names, and where its files are: the one place that decides.

A source (LoadModelRequest.source, InitRequest.model, ``--model``) is, in this order:

- a built-in model's name (``tiny``, ``tiny-flux``, ...): built into the model cache on first use;
- a path on the runner: absolute (``/models/sd-turbo``), explicitly relative (``./sd-turbo``), or
  relative and existing (``models/sd-turbo``, as diffusers' ``from_pretrained`` tries a directory
  first);
- a Hugging Face id spelt as ``serving_common.hub_ids`` says, ``org/name`` or
  ``org/name@revision`` (a branch, tag or commit): a snapshot in the hub cache (``HubCache``),
  found offline; downloaded only where the runner was started with ``--allow-download``;
- anything else: a path, which the caller reports missing.

``locate`` answers with the files to read, the roots those reads are confined to (the hub cache
for an id, so that a snapshot's links into ``blobs/`` are followed inside it and nowhere else) and,
for an id, the commit it resolved to: ModelInfo.revision, which the worker pins so that a
restarted runner loads the same snapshot.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

from runner_service.model_roots import ModelRoots
from runner_service.models.catalog import BUILTIN_MODELS, ensure_builtin
from serving_common.errors import not_found, unavailable
from serving_common.hub_ids import HubId

logger = logging.getLogger(__name__)

# Fetches an id into a hub cache; returns the snapshot folder it wrote.
Download = Callable[[HubId, Path], Path]


class SourceKind(enum.Enum):
    BUILTIN = "built-in"
    PATH = "path"
    HUB = "Hugging Face id"


@dataclass(frozen=True)
class LocatedSource:
    """A source and what it names: ``path`` (a built-in's or a snapshot's directory, or the path
    as given), the ``roots`` its reads are confined to, and for an id the resolved commit."""

    source: str
    kind: SourceKind
    path: Path
    roots: ModelRoots
    revision: str = ""


def download_pipeline(hub_id: HubId, cache: Path) -> Path:
    """The hub's own download of a diffusers pipeline (only the files ``from_pretrained`` reads;
    the token is the hub library's, from the environment: ``HF_TOKEN`` or ``hf auth login``)."""
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    folder = DiffusionPipeline.download(hub_id.repo_id, revision=hub_id.revision or None, cache_dir=cache)
    return Path(folder)


class HubCache:
    """The Hugging Face hub cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``), read offline:
    an id is looked up with ``snapshot_download(local_files_only=True)``, the hub library's own
    resolution of ``refs/`` and ``snapshots/``. ``download``, where given (``--allow-download``),
    fetches an id the cache lacks; without it nothing is ever fetched."""

    def __init__(self, directory: Path | None = None, download: Download | None = None) -> None:
        self.directory = Path(directory or constants.HF_HUB_CACHE)
        self.roots = ModelRoots([self.directory])
        self._download = download

    def snapshot(self, hub_id: HubId, field: str = "source") -> Path:
        """The snapshot folder ``hub_id`` names here (inside the cache, PERMISSION_DENIED else);
        NOT_FOUND, saying where it looked and how to fetch it, when the cache lacks it and no
        download is allowed."""
        try:
            folder = Path(snapshot_download(hub_id.repo_id, revision=hub_id.revision or None,
                                            cache_dir=self.directory, local_files_only=True))
        except IncompleteSnapshotError as error:
            # The hub's file list names files this snapshot lacks: diffusers fetches only those its
            # pipeline reads, so a snapshot it downloaded is "incomplete". Loading says what is missing.
            logger.info("%s: using the partial snapshot %s", hub_id, error.snapshot_path)
            folder = Path(error.snapshot_path)
        except LocalEntryNotFoundError:
            if self._download is None:
                raise not_found(self.missing(hub_id)) from None
            logger.info("%s is not in the hub cache %s: downloading it (--allow-download)", hub_id, self.directory)
            try:
                folder = self._download(hub_id, self.directory)
            except Exception as error:  # noqa: BLE001 - the hub, the network or the repository: all told as they are
                raise unavailable(f"{str(hub_id)!r} is not in the Hugging Face cache on the runner and downloading "
                                  f"it failed: {type(error).__name__}: {error}") from error
        return self.roots.check(folder, field)

    def missing(self, hub_id: HubId) -> str:
        """Why ``hub_id`` cannot be loaded here, and how to make it loadable."""
        fetch = f"hf download {hub_id.repo_id}" + (f" --revision {hub_id.revision}" if hub_id.revision else "")
        folder = self.directory / f"models--{hub_id.repo_id.replace('/', '--')}"
        return (f"{str(hub_id)!r} is not a built-in model nor in the Hugging Face cache on the runner (looked in "
                f"{folder}); fetch it there with `{fetch}` (HF_HUB_CACHE or HF_HOME name the cache), or start the "
                "runner with --allow-download")


def locate(source: str, builtin_cache: Path | None, roots: ModelRoots, hub: HubCache) -> LocatedSource:
    """What ``source`` names (see the module's docstring); a built-in is built here on first use,
    and an id missing from the cache is NOT_FOUND (or downloaded, where allowed)."""
    if source in BUILTIN_MODELS:
        return LocatedSource(source, SourceKind.BUILTIN, ensure_builtin(source, builtin_cache), ModelRoots())
    hub_id = None if _is_path(source) else HubId.parse(source)
    if hub_id is None:
        return LocatedSource(source, SourceKind.PATH, Path(source), roots)
    snapshot = hub.snapshot(hub_id)
    return LocatedSource(source, SourceKind.HUB, snapshot, hub.roots, revision=snapshot.name)


def _is_path(source: str) -> bool:
    """Whether ``source`` can only be a path: absolute, explicitly relative, or existing."""
    return source.startswith(("/", "./", "../", "~")) or Path(source).exists()
