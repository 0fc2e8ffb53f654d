"""What the step loop, the request-level call and the runner's counters ask of a step cache, whichever
method it is (``RowCache``: the First Block Cache on a transformer; ``UNetCache``: DeepCache on a
UNet; ``TaylorSeerCache``: TaylorSeer on a transformer). Each keeps its state per row: an image's
guidance branch, named by the caller (the bookkeeping they share is ``row_state.PerRowCache``)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Hashable, Sequence
from typing import Protocol


class StepCache(Protocol):
    """A step cache attached to a loaded model's denoiser."""

    threshold: float  # the model's setting: a threshold, or an interval for an interval-based method
    rows_run: int  # denoiser rows seen, since load
    rows_skipped: int  # of those, the rows that reused cached work

    @property
    def live_rows(self) -> int:
        """How many rows hold a cached state now."""
        ...

    def threshold_for(self, requested: float | None) -> float:
        """A row's setting: the request's where it set one, else the model's."""
        ...

    def rows(self, keys: Sequence[Hashable], thresholds: Sequence[float],
             remaining: Sequence[int]) -> contextlib.AbstractContextManager[None]:
        """The next denoiser call's rows, in order, each with its setting (0: no caching) and its
        denoiser calls left, this one included (1: the row's last step)."""
        ...

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these (the step loop's running rows)."""
        ...

    def pipeline_call(self, thresholds: Sequence[float],
                      steps: int | None) -> contextlib.AbstractContextManager[None]:
        """Around a pipeline's own ``__call__`` of ``len(thresholds)`` images, each with its setting,
        whose rows are each called ``steps`` times (the cache counts the calls; None: not known)."""
        ...

    def reset(self) -> None:
        """Forgets every row's state (the weights changed, or the model woke)."""
        ...

    def remove(self) -> None:
        """Detaches the cache: the denoiser runs as before."""
        ...
