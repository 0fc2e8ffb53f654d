"""Offload stores: where sleep level 1 keeps a component's weights while they are off the device."""

from __future__ import annotations

import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from serving_common.owned_dirs import lock_directory, owned_temporary_directory, remove_abandoned

logger = logging.getLogger(__name__)

# The prefix of a runner's own spill directory in the temporary directory (serving_common.owned_dirs).
SPILL_PREFIX = "diffusion-runner-spill-"


class OffloadStore(ABC):
    """Holds named tensor sets by key; ``take`` returns them on ``device`` and forgets them."""

    @abstractmethod
    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def get(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        """A copy of what ``key`` holds on ``device``; the store keeps its own until ``discard``."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Forgets ``key`` (nothing when it is not held); never raises."""

    def close(self) -> None:
        """Releases everything the store holds."""


class PinnedHostStore(OffloadStore):
    """Accelerators: page-locked host memory, so copies both ways run at full bus speed."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        host = {}
        for name, tensor in tensors.items():
            host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host[name].copy_(tensor, non_blocking=True)
        self._synchronize()
        self._held[key] = host

    def get(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        host = self._held[key]
        on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in host.items()}
        self._synchronize()
        return on_device

    def discard(self, key: str) -> None:
        self._held.pop(key, None)

    def close(self) -> None:
        self._held.clear()


class SpillFileStore(OffloadStore):
    """CPU: the device already is host memory, so sleeping weights go to a file the runner owns.

    Each key is one safetensors file in a private directory, written at sleep and read back
    (then deleted) at wake, so the process's resident memory really drops while asleep. The
    default directory is an owned temporary directory (``serving_common.owned_dirs``), made at the
    first sleep (a runner that never sleeps, or fails to start, makes none) and removed at close; a
    runner starting removes those of runners that were killed. A directory given explicitly
    (``--spill-dir``) is locked the same way for the runner's lifetime (two runners cannot share
    one) and emptied of spill files at start and at close.
    """

    def __init__(self, directory: Path | None = None) -> None:
        remove_abandoned(SPILL_PREFIX, lambda gone: logger.info("removed %s, left by a runner that was killed", gone))
        self._owned = directory is None
        self._directory = directory
        self._lock: int | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock = lock_directory(directory)
            if self._lock is None:
                raise RuntimeError(f"spill directory {directory} is in use by another runner")
            self._remove_spill_files()

    @property
    def directory(self) -> Path:
        """Where the spill files go; the default directory is made at first use."""
        if self._directory is None:
            self._directory = owned_temporary_directory(SPILL_PREFIX)
        return self._directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _remove_spill_files(self) -> None:
        for path in self.directory.glob("*.safetensors"):
            self._unlink(path)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("cannot remove spill file %s: %s", path, error)

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({name: t.contiguous() for name, t in tensors.items()}, self._path(key))

    def get(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        mapped = load_file(self._path(key), device="cpu")
        # The loaded tensors view the file's memory map; copy them into process memory so the
        # file can go and RSS accounting stays honest.
        owned = {}
        for name in list(mapped):
            owned[name] = mapped.pop(name).to(device, copy=True)
        return owned

    def discard(self, key: str) -> None:
        if self._directory is not None:
            self._unlink(self._path(key))

    def close(self) -> None:
        if self._directory is None:
            return
        if self._owned:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        else:
            self._remove_spill_files()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
