"""A log line for events an attacker can repeat at will (refused connections, timed-out clients,
failed accepts): at most one line per interval, saying how many happened since the last one, so
that a flood of them cannot fill the disk with the log."""

from __future__ import annotations

import logging
import time


class ThrottledLog:
    """Logs ``message`` (a %-format with one ``%d``: the count) at most once per ``interval_s``."""

    def __init__(self, logger: logging.Logger, level: int, message: str, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._level = level
        self._message = message
        self._interval_s = interval_s
        self._count = 0
        self._last = -interval_s  # the first event logs at once

    def __call__(self) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self._interval_s:
            self._logger.log(self._level, self._message, self._count)
            self._count = 0
            self._last = now
