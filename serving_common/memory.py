"""Handing freed heap memory back to the OS (glibc), for the worker and the runner alike."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
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


class HeapTrimmer:
    """Runs ``trim_host_heap`` on a thread of its own when asked, one trim at a time: asked while
    one runs, it runs once more after it, so memory freed meanwhile goes back too. Callable from
    any thread; never blocks the caller (``malloc_trim`` can take tens of ms on a large heap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False
        self._again = False

    def request(self) -> None:
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        threading.Thread(target=self._run, name="heap-trim", daemon=True).start()

    def _run(self) -> None:
        while True:
            trim_host_heap()
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False
