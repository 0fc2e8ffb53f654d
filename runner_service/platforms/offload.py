"""Offload stores: where sleep level 1 keeps a component's weights while they are off the device."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

# A default spill directory is named after its runner: <prefix><pid>-<random>.
SPILL_PREFIX = "diffusion-runner-spill-"
_SPILL_NAME = re.compile(re.escape(SPILL_PREFIX) + r"(\d+)-")
# Held (flock) by the runner using a spill directory for as long as it runs: the kernel lets go
# when the process dies, however it dies, and the lock holds across PID namespaces.
LOCK_NAME = ".owner.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _locked_elsewhere(directory: Path) -> bool:
    try:
        descriptor = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep it
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)
    return False


def remove_stale_spill_dirs(parent: Path) -> list[Path]:
    """Removes the spill directories under ``parent`` left by runners that are gone (killed ones
    never clean up, and each holds a full copy of the weights it had put to sleep).

    A directory is stale when it is named ``<SPILL_PREFIX><pid>-...``, is this user's, its PID is
    not alive and nobody holds its lock. Returns the directories removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _SPILL_NAME.match(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        directory = Path(entry.path)
        if _pid_alive(int(match.group(1))) or _locked_elsewhere(directory):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        logger.info("removed the spill directory %s of runner %s, which is gone", directory, match.group(1))
        removed.append(directory)
    return removed


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
    default directory is named after the runner's PID and removed at exit; a runner starting
    removes those of runners that died without doing so (whatever its own directory). A
    directory given explicitly is locked for the runner's lifetime (two runners cannot share
    one) and emptied of leftovers at start.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self._owned = directory is None
        parent = Path(tempfile.gettempdir())
        remove_stale_spill_dirs(parent)
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=parent))
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock: IO[bytes] | None = self._hold_lock()
        if not self._owned:
            self._remove_spill_files()

    def _hold_lock(self) -> IO[bytes]:
        lock = open(self.directory / LOCK_NAME, "ab")  # held open, and locked, for the store's lifetime
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(f"spill directory {self.directory} is in use by another runner") from None
        return lock

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
        self._unlink(self._path(key))

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            self._remove_spill_files()
        if self._lock is not None:
            self._lock.close()
            self._lock = None
