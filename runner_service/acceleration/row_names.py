"""The names and settings of a step cache's rows in the next denoiser call, as its caller gives them.

The step loop names each call's rows itself (``rows``: each sequence's guidance branches, each with
its request's setting). Around a pipeline's own ``__call__`` (``pipeline_call``) the pipeline makes
the calls: there a row is its position within the pipeline's ``cache_context`` ("cond", "uncond"),
and row r is image ``r % images`` (guided pipelines stack the negative rows first); every state is
dropped before and after the call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence


class RowNames:
    """A cache's plan for its next denoiser call; ``reset`` forgets the cache's states."""

    def __init__(self, reset: Callable[[], None]) -> None:
        self._reset = reset
        self._keys: list[Hashable] | None = None  # the step loop's next call's rows
        self._settings: list[float] = []
        self._images: list[float] | None = None  # the pipeline call's settings, per image

    @contextlib.contextmanager
    def rows(self, keys: Sequence[Hashable], settings: Sequence[float]) -> Iterator[None]:
        """The next denoiser call's rows, in order, each with its setting."""
        if len(keys) != len(settings) or len(set(keys)) != len(keys):
            raise ValueError("one distinct key and one setting per row")
        self._keys, self._settings = list(keys), list(settings)
        try:
            yield
        finally:
            self._keys = None

    @contextlib.contextmanager
    def pipeline_call(self, settings: Sequence[float]) -> Iterator[None]:
        """Around a pipeline's ``__call__`` of ``len(settings)`` images, each with its setting."""
        self._reset()
        self._images = list(settings)
        try:
            yield
        finally:
            self._images = None
            self._reset()

    def planned(self, rows: int, context: str | None) -> tuple[list[Hashable], list[float]] | None:
        """The names and settings of a denoiser call of ``rows`` rows (under the pipeline's
        ``context``); None when no call is planned (plain)."""
        if self._keys is not None:
            keys, settings = self._keys, self._settings
        elif self._images is not None:
            images = len(self._images)
            if rows % images:
                raise ValueError(f"a denoiser call of {rows} rows for {images} images")
            keys = [(context, row) for row in range(rows)]
            settings = [self._images[row % images] for row in range(rows)]
        else:
            return None
        if len(keys) != rows:
            raise ValueError(f"a denoiser call of {rows} rows, planned for {len(keys)}")
        return keys, settings
