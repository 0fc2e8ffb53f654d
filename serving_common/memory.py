"""Handing freed heap memory back to the OS (glibc), for the worker and the runner alike."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def trim_host_heap() -> None:
    """Gives freed heap memory back to the OS.

    glibc keeps freed blocks in its arenas, so a process that freed hundreds of megabytes (tensors,
    decoded images) still shows them in its RSS until ``malloc_trim(0)`` returns them. A no-op
    where the C library has no ``malloc_trim``.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
