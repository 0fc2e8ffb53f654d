"""Offload stores: where sleep level 1 keeps a component's weights while they are off the device."""

from __future__ import annotations

import logging
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)


class OffloadStore(ABC):
    """Holds named tensor sets by key; ``take`` returns them on ``device`` and forgets them."""

    @abstractmethod
    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def take(self, key: str, device: torch.device) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def discard(self, key: str) -> None: ...

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

    def take(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        host = self._held.pop(key)
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
    (then deleted) at wake, so the process's resident memory really drops while asleep.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._owned = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="diffusion-runner-spill-"))
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({name: t.contiguous() for name, t in tensors.items()}, self._path(key))

    def take(self, key: str, device: torch.device) -> dict[str, torch.Tensor]:
        path = self._path(key)
        mapped = load_file(path, device="cpu")
        # The loaded tensors view the file's memory map; copy them into process memory so the
        # file can go and RSS accounting stays honest.
        owned = {}
        for name in list(mapped):
            owned[name] = mapped.pop(name).to(device, copy=True)
        path.unlink()
        return owned

    def discard(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            for path in self.directory.glob("*.safetensors"):
                path.unlink(missing_ok=True)
