"""What one image costs the loaded model here, measured as it runs (``ModelInfo.costs``).

Each request-level pipeline call, and each step of a step batch whose images are all of one size,
gives one observation per image: a denoising step's time and the decode's. The last observations
per size are kept (a moving average, so one slow step does not stand for the size), for at most
``MAX_SIZES`` sizes (the least recently seen goes). The worker turns them into a request's time
with ``serving_common.cost``. Written on the device thread, read by GetInfo on the event loop:
each update replaces one dictionary entry, which the GIL keeps whole.
"""

from __future__ import annotations

from serving_common.cost import CostPoint

MAX_SIZES = 16
WEIGHT = 0.5  # of a new observation in the moving average


class CostMeter:
    def __init__(self) -> None:
        self._points: dict[int, CostPoint] = {}

    def observe(self, pixels: int, step_ms: float | None = None, decode_ms: float | None = None) -> None:
        """One image of ``pixels``: one of its steps took ``step_ms``, its decode ``decode_ms`` (either may
        be unknown from this observation)."""
        old = self._points.pop(pixels, None)

        def blended(new: float | None, before: float | None) -> float:
            if new is None:
                return before or 0.0
            return new if not before else WEIGHT * new + (1 - WEIGHT) * before

        self._points[pixels] = CostPoint(pixels, blended(step_ms, old.step_ms if old else None),
                                         blended(decode_ms, old.decode_ms if old else None))
        while len(self._points) > MAX_SIZES:
            del self._points[next(iter(self._points))]

    def points(self) -> list[CostPoint]:
        """The sizes measured, smallest first."""
        return sorted(self._points.values(), key=lambda point: point.pixels)
