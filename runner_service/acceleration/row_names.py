"""The names, settings and remaining steps of a step cache's rows in the next denoiser call, as its
caller gives them.

The step loop names each call's rows itself (``rows``: each sequence's guidance branches, each with
its request's setting and its sequence's denoiser calls left). Around a pipeline's own ``__call__``
(``pipeline_call``) the pipeline makes the calls: there a row is its position within the pipeline's
``cache_context`` ("cond", "uncond"), row r is image ``r % images`` (guided pipelines stack the
negative rows first), and a row's calls left are the call's steps less the calls it has had; every
state is dropped before and after the call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowPlan:
    """A row's part in a denoiser call: its setting (0: no caching) and how many denoiser calls it
    has left, this one included (1: its last step; None: not known)."""

    setting: float
    remaining: int | None


class RowNames:
    """A cache's plan for its next denoiser call; ``reset`` forgets the cache's states."""

    def __init__(self, reset: Callable[[], None]) -> None:
        self._reset = reset
        self._keys: list[Hashable] | None = None  # the step loop's next call's rows
        self._plans: list[RowPlan] = []
        self._images: list[float] | None = None  # the pipeline call's settings, per image
        self._steps: int | None = None  # the pipeline call's denoiser calls per row

    @contextlib.contextmanager
    def rows(self, keys: Sequence[Hashable], settings: Sequence[float], remaining: Sequence[int]) -> Iterator[None]:
        """The next denoiser call's rows, in order, each with its setting and its calls left (this
        one included)."""
        if not len(keys) == len(settings) == len(remaining) or len(set(keys)) != len(keys):
            raise ValueError("one distinct key, one setting and one count of calls left per row")
        if any(left < 1 for left in remaining):
            raise ValueError(f"a row in a denoiser call has at least that call left, got {list(remaining)}")
        self._keys = list(keys)
        self._plans = [RowPlan(setting, left) for setting, left in zip(settings, remaining, strict=True)]
        try:
            yield
        finally:
            self._keys = None

    @contextlib.contextmanager
    def pipeline_call(self, settings: Sequence[float], steps: int | None) -> Iterator[None]:
        """Around a pipeline's ``__call__`` of ``len(settings)`` images, each with its setting, whose
        rows are each called ``steps`` times (None: not known)."""
        if steps is not None and steps < 1:
            raise ValueError(f"a pipeline call of {steps} steps")
        self._reset()
        self._images, self._steps = list(settings), steps
        try:
            yield
        finally:
            self._images, self._steps = None, None
            self._reset()

    def planned(self, rows: int, context: str | None,
                taken: Callable[[Hashable], int]) -> tuple[list[Hashable], list[RowPlan]] | None:
        """The names and plans of a denoiser call of ``rows`` rows (under the pipeline's
        ``context``; ``taken``: how many calls a row has had, within a pipeline call); None when no
        call is planned (plain)."""
        if self._keys is not None:
            keys, plans = self._keys, self._plans
        elif self._images is not None:
            images, steps = len(self._images), self._steps
            if rows % images:
                raise ValueError(f"a denoiser call of {rows} rows for {images} images")
            keys = [(context, row) for row in range(rows)]
            plans = [RowPlan(self._images[row % images], None if steps is None else steps - taken(key))
                     for row, key in enumerate(keys)]
        else:
            return None
        if len(keys) != rows:
            raise ValueError(f"a denoiser call of {rows} rows, planned for {len(keys)}")
        return keys, plans
