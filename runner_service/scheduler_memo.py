"""A process-wide memo of facts that follow from a scheduler's class, flags and config alone.

A model's samplers are built from its scheduler's config and dry-run at every load
(``runner_service.samplers``); the same config gives the same schedulers and the same verdicts, so
a reload, a level-2 wake's reload or a second model of the same config in this process finds them
here instead of building them again (a KDPM2 scheduler's build sets a schedule of every training
step: about 0.15 s of CPU each). Entries are keyed by value (``frozen``), never by the scheduler
object, and the least recently used go first past a fixed count, so memory stays bounded whatever
configs arrive. What diffusers itself logs while building one (a config key neither class takes,
shown only at ``--log-level debug``: ``runner_service.libraries``) comes at its first build here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

_SCALARS = (str, int, bool, type(None), bytes)  # hashable, and equal only to the same value of the same type


class Unkeyable(Exception):
    """A value ``frozen`` cannot tell apart from others by value (an object of no known kind)."""


def frozen(value: Any) -> Hashable:
    """``value`` (a config and what it holds: scalars, lists, tuples, mappings, numpy arrays; or a
    class) as a hashable key equal only to the key of an equal value of the same types, in the same
    order (1 and 1.0, -0.0 and 0.0, a list and a tuple are told apart); raises ``Unkeyable`` for
    anything else."""
    kind = type(value)
    if isinstance(value, type):  # a class is itself: one class object per class in a process
        return kind, value
    if kind in _SCALARS:
        return kind, value
    if kind is float or isinstance(value, np.generic):
        return kind, repr(value)  # the shortest repr that reads back the same float, nan and -0.0 included
    if isinstance(value, list | tuple):
        return kind, tuple(frozen(item) for item in value)
    if isinstance(value, Mapping):
        return kind, tuple((frozen(key), frozen(item)) for key, item in value.items())
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return kind, value.dtype.str, value.shape, value.tobytes()
    raise Unkeyable(kind.__qualname__)


class BoundedMemo:
    """The values of a few hundred keys at most, least recently used out first; safe to share
    between threads. A value is computed outside the lock (two threads that miss the same key
    both compute it, and the first one stored is the one kept), so a slow computation never
    holds up another key's lookup. Callers hand out copies of mutable values."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.computed = 0  # values computed on a miss, in all
        self._values: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The value of ``key``, computed by ``compute`` where it is not held."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                found: T = self._values[key]
                return found
        value = compute()
        with self._lock:
            self.computed += 1
            kept: T = self._values.setdefault(key, value)
            self._values.move_to_end(key)
            while len(self._values) > self.entries:
                self._values.popitem(last=False)
        return kept
