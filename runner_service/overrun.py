"""Device work that goes on for nobody ends the runner.

A denoising step, or a VAE decode, cannot be interrupted: an execution whose caller has gone (its
deadline passed, it was cancelled, the worker gave up on it) stops at its next step boundary, but
one step of a large image can take minutes on a CPU. Work that has gone on for longer than
``--overrun-exit-after`` seconds after the last of the callers it serves left computes for nobody
and holds the device from everyone else: the runner logs why and exits with ``OVERRUN_EXIT``, so
that its supervisor (Kubernetes, ``deploy/pod.py``) starts a fresh one, which the worker brings
back to the desired state.

The device thread marks each unit of work it runs (``working``: the steps the step engine runs
between two returns to its event loop, during which its callers do not change; one pipeline call of
a request-level batch) with the callers it serves; a daemon thread looks at the unit every second.
Units that serve no caller (a load, a sleep) are never ended: their callers' deadlines are handled
by ``CallWatch``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import NoReturn

logger = logging.getLogger(__name__)

# How the runner exits when it ended work that outlived its callers (the group's RANK_DIED_EXIT is 3).
OVERRUN_EXIT = 4
CHECK_INTERVAL_S = 1.0


class Abandonment:
    """Whether an execution's caller has gone, and since when: the ``StopFlag`` its run polls at
    each step boundary."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.since: float | None = None  # time.monotonic() when the caller went

    def set(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class DeviceWork:
    """The unit of work the device thread runs now, and the watchdog that ends the runner when it
    outlives its callers by ``limit_s`` seconds (0: never)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._unit: tuple[float, tuple[Abandonment, ...]] | None = None
        self._watching = False

    @contextlib.contextmanager
    def working(self, callers: Sequence[Abandonment] = ()) -> Iterator[None]:
        """Marks one unit of device work serving ``callers`` (none: not an execution)."""
        self._unit = (time.monotonic(), tuple(callers))
        try:
            yield
        finally:
            self._unit = None

    def busy_s(self) -> float:
        """Seconds the current unit has run; 0 while the device is idle."""
        unit = self._unit
        return 0.0 if unit is None else time.monotonic() - unit[0]

    def overrun_s(self) -> float:
        """Seconds the current unit has gone on since the last of its callers left; 0 while any waits."""
        unit = self._unit
        if unit is None or not unit[1] or not all(caller.is_set() for caller in unit[1]):
            return 0.0
        left = max(caller.since or 0.0 for caller in unit[1])
        return max(time.monotonic() - max(left, unit[0]), 0.0)

    def watch(self) -> None:
        """Starts the watchdog thread (once; not with a limit of 0)."""
        if self.limit_s <= 0 or self._watching:
            return
        self._watching = True
        threading.Thread(target=self._watch, name="overrun watchdog", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(CHECK_INTERVAL_S, self.limit_s / 4))
            overrun = self.overrun_s()
            if overrun > self.limit_s:
                exit_now(OVERRUN_EXIT, f"device work has gone on {overrun:.1f} s after every caller it serves "
                         f"left (its deadline passed or it was cancelled), past --overrun-exit-after "
                         f"{self.limit_s:g} s, and it cannot be interrupted mid-step: exiting with code "
                         f"{OVERRUN_EXIT} so that a fresh runner replaces this one")


def exit_now(code: int, why: str) -> NoReturn:
    """Ends the process at once with ``code``, saying ``why``, without waiting for the device thread
    (an interpreter's exit would join it, however long its step)."""
    logger.critical("%s", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)
