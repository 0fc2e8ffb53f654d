"""Which steps' progress an Execute call is sent (``ExecuteRequest.progress_interval_ms``).

A streaming client wants every step (the default, an interval of 0). A caller that reads progress
only as a heartbeat (the worker, for a request nobody streams: stall detection and GetStatus) asks
for at most one message an interval, so a fast step does not pay for a gRPC message, a wake-up of
the event loop and the worker's read of it (issue 40: most of the serving cost per step on a CPU).
A phase's first and last steps and every step that carries previews are sent whatever the interval.
"""

from __future__ import annotations

import math
import time


class ProgressPacing:
    """One call's pacing; asked on the device thread, at each step, in order."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self._sent_at = -math.inf
        self._phase: int | None = None

    @classmethod
    def of(cls, progress: bool, interval_ms: int) -> ProgressPacing | None:
        """The pacing an ExecuteRequest asks for; None when it asks for no progress."""
        return cls(interval_ms / 1000) if progress else None

    def due(self, step: int, total: int, phase: int, previews: bool) -> bool:
        """Whether this step's progress is sent (and, if so, it counts as sent now)."""
        now = time.perf_counter()
        if previews or step >= total or phase != self._phase or now - self._sent_at >= self.interval_s:
            self._sent_at, self._phase = now, phase
            return True
        return False
