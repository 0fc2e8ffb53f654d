"""How long a request takes on a runner, from what one image cost it at the sizes it measured
(``ModelInfo.costs``: per denoising step and for decoding).

Between two measured sizes the cost is interpolated linearly in pixels; below the smallest it is
the smallest's. Beyond the largest it grows as ``a + b x pixels^2`` through the two largest points:
attention, which dominates large images, is quadratic in the pixels, and the overhead that
dominates small ones (``a``) does not grow. With one point, or points that do not grow, it grows
quadratically from the largest (overhead counted as if it grew too: an over-estimate, which refuses
rather than abandons). An estimate is an estimate: the runner's ``--overrun-exit-after`` bounds what
an under-estimate costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostPoint:
    """What one image of ``pixels`` cost: one denoising step, and its decode, in milliseconds."""

    pixels: int
    step_ms: float
    decode_ms: float


def _at(points: Sequence[tuple[int, float]], pixels: int) -> float:
    """The cost at ``pixels`` of (pixels, ms) points sorted by pixels."""
    first_pixels, first_ms = points[0]
    if pixels <= first_pixels:
        return first_ms
    for (low, low_ms), (high, high_ms) in zip(points, points[1:], strict=False):
        if pixels <= high:
            return low_ms + (high_ms - low_ms) * (pixels - low) / (high - low)
    last, last_ms = points[-1]
    quadratic = last_ms * (pixels / last) ** 2
    if len(points) < 2:
        return quadratic
    before, before_ms = points[-2]
    growth = (last_ms - before_ms) / (last * last - before * before)
    if growth <= 0:
        return quadratic
    return max(last_ms + growth * (pixels * pixels - last * last), last_ms * pixels / last)


def image_ms(points: Sequence[CostPoint], pixels: int) -> tuple[float, float] | None:
    """(one step, the decode) of one image of ``pixels``, in milliseconds, each from the points that
    measured it; None without a step measured."""
    ordered = sorted(points, key=lambda point: point.pixels)
    steps = [(p.pixels, p.step_ms) for p in ordered if p.step_ms > 0]
    decodes = [(p.pixels, p.decode_ms) for p in ordered if p.decode_ms > 0]
    if not steps:
        return None
    return _at(steps, pixels), _at(decodes, pixels) if decodes else 0.0


def request_seconds(points: Sequence[CostPoint], pixels: int, steps: int, images: int) -> float | None:
    """Seconds of device time a request of ``images`` images of ``pixels``, ``steps`` steps each,
    takes by the points; None without points."""
    costs = image_ms(points, pixels)
    if costs is None:
        return None
    step_ms, decode_ms = costs
    return images * (steps * step_ms + decode_ms) / 1000
