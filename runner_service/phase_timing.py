"""Where a batch's time went on the runner, phase by phase (``RunnerTimings``).

The points come from the platform (``Platform.time_point``): device events on an accelerator, the
host's clock on a CPU. Spans are only resolved to milliseconds once the batch's output is on the
host, so timing never makes the device wait mid-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from diffusion.v1 import common_pb2
from runner_service.platforms import HostPoint, TimePoint

Clock = Callable[[], TimePoint]

TEXT_ENCODE, DENOISE, DECODE, TO_HOST = "text_encode", "denoise", "decode", "to_host"
PHASES = (TEXT_ENCODE, DENOISE, DECODE, TO_HOST)


@dataclass(frozen=True)
class PhaseTimes:
    """Milliseconds by phase; a phase the batch did not go through (or could not be told apart) is 0."""

    text_encode_ms: float = 0.0
    denoise_ms: float = 0.0
    decode_ms: float = 0.0
    to_host_ms: float = 0.0

    def to_proto(self) -> common_pb2.RunnerTimings:
        return common_pb2.RunnerTimings(text_encode_ms=self.text_encode_ms, denoise_ms=self.denoise_ms,
                                        decode_ms=self.decode_ms, to_host_ms=self.to_host_ms)


class PhaseSpans:
    """The spans of one batch (or one step-batched submission), by phase; a phase may have several
    (a submission's steps), whose times add up."""

    def __init__(self, clock: Clock = HostPoint) -> None:
        self.clock = clock
        self._spans: dict[str, list[tuple[TimePoint, TimePoint]]] = {phase: [] for phase in PHASES}

    def add(self, phase: str, start: TimePoint, end: TimePoint) -> None:
        self._spans[phase].append((start, end))

    def extend(self, other: PhaseSpans) -> None:
        """Adds ``other``'s spans (a step's, shared by the submissions in it)."""
        for phase, spans in other._spans.items():
            self._spans[phase].extend(spans)

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        start = self.clock()
        yield
        self.add(phase, start, self.clock())

    def resolve(self) -> PhaseTimes:
        """The phases' milliseconds (on an accelerator: once the device has reached the last point)."""
        totals = {phase: sum(end.ms_since(start) for start, end in spans) for phase, spans in self._spans.items()}
        return PhaseTimes(*(max(0.0, totals[phase]) for phase in PHASES))


@contextlib.contextmanager
def returns_observed(target: object, name: str, observe: Callable[[], None]) -> Iterator[None]:
    """Calls ``observe`` whenever ``target.<name>(...)`` returns, while the block runs (an instance
    attribute over the method, taken away after: what the object had before is back); a target
    without such a method is left alone."""
    method = getattr(target, name, None)
    if not callable(method):
        yield
        return
    missing = object()
    own = vars(target).get(name, missing)

    def observed(*args: object, **kwargs: object) -> object:
        result = method(*args, **kwargs)
        observe()
        return result

    setattr(target, name, observed)
    try:
        yield
    finally:
        if own is missing:
            delattr(target, name)
        else:
            setattr(target, name, own)
