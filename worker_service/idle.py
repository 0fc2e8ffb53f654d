"""Idle management: put the model to sleep after ``--sleep-after-idle`` seconds without requests.

Any WorkerService call but GetStatus counts as activity (its start and its end), and so does the
worker becoming READY (after a WakeUp, an Init or a runner restart), so a model is never put
back to sleep right after someone woke it. The sleep is an ordinary ``Sleep`` at
``--idle-sleep-level`` through the model controller; with ``--auto-wake`` the next Generate wakes
the model again (level 1 restores the weights bit-identically; level 2 reloads them from the
model's source, dropping weight updates). GetStatus reports ``idle_sleep_after_s`` and
``last_sleep_idle``; metrics count ``diffusion_idle_sleeps_total``.

``busy()`` says whether any request is queued, running or encoding; ``on_sleep`` hears of each
idle sleep (the metrics count them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from diffusion.v1 import worker_pb2
from serving_common.errors import ServiceError
from worker_service.controller import ModelController
from worker_service.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

QUIET_METHODS = frozenset({"GetStatus"})
MAX_POLL_S = 1.0


class IdleSleeper:
    def __init__(self, after_s: float, level: int, controller: ModelController, lifecycle: Lifecycle,
                 busy: Callable[[], bool], on_sleep: Callable[[], None]) -> None:
        self.after_s = after_s
        self.level = level
        self._controller = controller
        self._lifecycle = lifecycle
        self._busy = busy
        self._on_sleep = on_sleep
        self._calls = 0
        self.last_activity = time.monotonic()
        self.last_sleep_idle = False
        self._was_ready = False

    @property
    def enabled(self) -> bool:
        return self.after_s > 0

    def on_call(self, method: str, finished_ok: bool) -> None:
        """ObservingInterceptor's callback, at the start (finished_ok False) and end of each call."""
        if method in QUIET_METHODS:
            return
        self.last_activity = time.monotonic()
        if method == "Sleep" and finished_ok:
            self.last_sleep_idle = False  # an explicit Sleep replaces whatever the timer did

    def idle_for(self) -> float:
        return time.monotonic() - self.last_activity

    async def run(self) -> None:
        """Forever (when enabled): checks a few times per ``after_s`` whether the model should sleep."""
        if not self.enabled:
            return
        poll = min(self.after_s / 4, MAX_POLL_S)
        while True:
            await asyncio.sleep(poll)
            ready = self._lifecycle.state == worker_pb2.WORKER_STATE_READY
            if ready and not self._was_ready:
                self.last_activity = time.monotonic()
            self._was_ready = ready
            if ready and not self._busy() and self.idle_for() >= self.after_s:
                await self._sleep()

    async def _sleep(self) -> None:
        idle = self.idle_for()
        try:
            await self._controller.sleep(self.level, [])
        except ServiceError as failure:
            logger.warning("idle sleep (level %d) failed: %s %s", self.level, failure.code.name, failure.message)
            self.last_activity = time.monotonic()  # try again after another idle period
            return
        self.last_sleep_idle = True
        self._was_ready = False
        self._on_sleep()
        logger.info("model put to sleep (level %d) after %.1f s without requests", self.level, idle)
