"""The runner's device: the one thread that runs device work, and the gate that decides who uses it.

The gate is the only owner of exclusive access. Two kinds of users share the device:

- the step engine (``step_engine.py``) runs step-batched executions one denoising step at a
  time and admits new submissions between steps, while no exclusive user is announced;
- exclusive users (LoadModel, Sleep, WakeUp, LoadWeights, PushWeights' apply, adapters, checksums,
  and request-level executions) have the device alone: once one announces itself the engine admits
  nothing more, and it gets the device once the running batch has drained, never mid-step.

Every device operation runs on one thread: each thread calling torch gets its own OpenMP team of
threads, and teams left spinning beside the working one slow it down (idle teams halved the
speed on two cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from runner_service.overrun import Abandonment, DeviceWork
from serving_common.errors import ServiceError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CallWatch:
    """Whether the caller of a device operation still waits for its answer.

    Device work runs in a thread that cannot be interrupted; it calls ``before_change`` right
    before it changes the model, which raises (and logs) once the call has ended, by its
    deadline or a cancellation, so an operation its caller was told failed never takes effect
    afterwards. ``time_remaining``: the call's seconds left when it started (None: no deadline).
    """

    def __init__(self, method: str, time_remaining: float | None = None) -> None:
        self.method = method
        self._ended = threading.Event()
        self._deadline = None if time_remaining is None else time.monotonic() + time_remaining

    def end(self) -> None:
        """The call is over (cancelled, or its deadline passed): the work must not take effect."""
        self._ended.set()

    @property
    def waiting(self) -> bool:
        """Whether the caller still waits: not cancelled, and before its deadline."""
        return not self._ended.is_set() and (self._deadline is None or time.monotonic() < self._deadline)

    def before_change(self) -> None:
        if self.waiting:
            return
        if self._ended.is_set():
            code, reason = grpc.StatusCode.CANCELLED, "the call was cancelled or timed out"
        else:
            code, reason = grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
        logger.warning("%s abandoned before changing the model: %s; nothing changed", self.method, reason)
        raise ServiceError(code, f"{self.method} abandoned: {reason}; nothing changed")


class DeviceGate:
    """The device thread and who holds the device: the step engine between exclusive users, or
    one exclusive user at a time. Exclusive users come first: once one is announced, the engine
    finishes its running batch and waits."""

    def __init__(self, overrun_exit_after_s: float = 0.0) -> None:
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="device")
        # What the device thread runs now; ends the runner when it outlives its callers.
        self.work = DeviceWork(overrun_exit_after_s)
        self._lock = asyncio.Lock()
        self._announced = 0  # exclusive users waiting for the device or holding it
        self._no_exclusive = asyncio.Event()
        self._no_exclusive.set()

    @property
    def exclusive_waiting(self) -> bool:
        """Whether an exclusive user waits for the device or holds it: the engine admits nothing then."""
        return self._announced > 0

    @property
    def busy(self) -> bool:
        """Whether someone holds the device (work abandoned by its caller holds it until it is done)."""
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def _announce(self) -> AsyncIterator[None]:
        self._announced += 1
        self._no_exclusive.clear()
        try:
            yield
        finally:
            self._announced -= 1
            if not self._announced:
                self._no_exclusive.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds the device alone, once the running step batch has drained."""
        async with self._announce(), self._lock:
            yield

    @contextlib.asynccontextmanager
    async def steps(self) -> AsyncIterator[None]:
        """The step engine's hold on the device, once no exclusive user is announced. The holder
        checks ``exclusive_waiting`` between steps and lets go once its running batch is done."""
        await self._no_exclusive.wait()
        async with self._lock:
            yield

    async def run(self, work: Callable[[], T], callers: Sequence[Abandonment] = ()) -> T:
        """Runs ``work`` on the device thread, serving ``callers`` (``DeviceWork``); the caller holds
        the device."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._marked(work, callers))

    def _marked(self, work: Callable[[], T], callers: Sequence[Abandonment]) -> Callable[[], T]:
        def marked() -> T:
            with self.work.working(callers):
                return work()

        return marked

    async def run_alone(self, watch: CallWatch, work: Callable[[], T]) -> T:
        """Runs ``work`` on the device thread, holding the device alone.

        When the call ends first (cancelled, or past its deadline), the thread cannot be stopped:
        it is told through ``watch``, so it changes nothing, and the device is held until it is
        done, so nothing else runs on the device alongside it.
        """
        async with self.exclusive():
            task = asyncio.get_running_loop().run_in_executor(self.thread, self._marked(work, ()))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                watch.end()
                while not task.done():
                    try:
                        await asyncio.wait({task})
                    except asyncio.CancelledError:
                        continue
                if not task.cancelled() and task.exception() is None:
                    logger.warning("%s finished after its call ended", watch.method)
                raise
