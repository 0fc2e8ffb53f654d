"""Temporary directories owned by the process that made them for as long as it lives, so that a
later start removes those of processes that were killed (SIGKILL: no cleanup ran).

The owner holds an ``flock`` on the directory through a descriptor it never closes: the kernel drops
the lock when the process ends, however it ends. A directory whose lock can be taken has no owner.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def lock_directory(directory: Path) -> int | None:
    """An flock on ``directory``, held until the returned descriptor is closed or this process ends
    (it is not inherited); None when another process holds it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def owned_temporary_directory(prefix: str) -> Path:
    """A new 0700 temporary directory named ``prefix...``, locked while this process lives. It is
    made under a hidden name and renamed once locked, so that no other process's
    ``remove_abandoned`` sees it unlocked in between."""
    staging = Path(tempfile.mkdtemp(prefix=f".{prefix}"))
    lock_directory(staging)  # its descriptor stays open: the lock lasts as long as we do
    directory = staging.with_name(staging.name.removeprefix("."))
    staging.rename(directory)
    return directory


def remove_abandoned(prefix: str, removed: Callable[[Path], None]) -> None:
    """Removes the temporary directories named ``prefix...`` whose owner has ended; ``removed`` is
    told of each."""
    for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            fd = lock_directory(directory)
        except OSError:  # gone meanwhile, or not ours
            continue
        if fd is not None:
            shutil.rmtree(directory, ignore_errors=True)
            os.close(fd)
            removed(directory)
