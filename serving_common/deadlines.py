"""Caller deadlines as gRPC can carry them onward.

A caller may ask for a timeout far beyond what gRPC carries. Its ``grpc-timeout`` header holds at
most 8 digits of a unit; gRPC's core sends at most 27,000 hours (97,200,000 s) whatever it is given.
Worse, gRPC Python turns a timeout into an absolute deadline in nanoseconds in an int64: one past
the year 2262 (a timeout of about 7e9 s now) wraps around and the call fails DEADLINE_EXCEEDED at
once. So a timeout the worker passes on is first clamped to ``MAX_TIMEOUT_S``: a caller who gave
more waits that long at most, about three years, which is no deadline in practice. The clients clamp
a timeout they are given the same way (``requested``), so ``inf`` or 1e10 s waits rather than fails.
"""

from __future__ import annotations

from serving_common.server import Context

MAX_TIMEOUT_S = 27_000 * 3600.0


def carried(timeout: float | None) -> float | None:
    """``timeout`` (seconds, None for none) at most ``MAX_TIMEOUT_S``."""
    return None if timeout is None else min(timeout, MAX_TIMEOUT_S)


def requested(timeout: float | None, name: str = "timeout") -> float | None:
    """A caller's ``timeout`` as it can be carried (``inf`` included); ValueError naming ``name`` for a
    value that is no duration (nan, negative)."""
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 (inf: no deadline), not {timeout}")
    return carried(timeout)


def time_left(context: Context) -> float | None:
    """The seconds left of a call's deadline as it can be passed on (None: no deadline)."""
    return carried(context.time_remaining())
