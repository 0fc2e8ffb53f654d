"""The runners the worker serves with: the list, their health Watch, one GetInfo poller, attach and detach.

The pool is the one owner of the runner list. A Watch per runner follows its health and reads
``GetInfo`` whenever it (re)appears, so a restart shows as a new instance id; the poller reads
every runner's info each ``poll_interval`` seconds for metrics and status, and probes a suspect
runner each second until it answers. Both tell the runner's handle, the one owner of its state.

``on_change(runner)`` hears of every change of a handle's state (the controller passes it at
``start``, to bring runners to its desired state); ``on_info(runner)`` of every info the poller
read. A runner leaves the list only under the gate, never in the middle of an operation on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from diffusion.v1 import runner_pb2
from serving_common.errors import ServiceError
from serving_common.protocol import RUNNER_SERVICE
from serving_common.server import SERVING
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import ChannelSettings, RunnerHandle, RunnerState

logger = logging.getLogger(__name__)

OnChange = Callable[[RunnerHandle], Coroutine[Any, Any, None]]  # also the type of on_info
RECONNECT_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 1.0
POLL_INTERVAL_S = 5.0
DETACH_TIMEOUT_S = 60.0


async def _no_change(runner: RunnerHandle) -> None:
    return None


class RunnerPool:
    def __init__(self, targets: Iterable[str], settings: ChannelSettings, gate: ExecutionGate,
                 poll_interval: float = POLL_INTERVAL_S) -> None:
        self._settings = settings
        self._gate = gate
        self._poll_interval = poll_interval
        self._runners = [self._handle(target) for target in targets]
        self._watches: dict[RunnerHandle, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # the changes told and the probes, while they run
        self._probed: set[RunnerHandle] = set()
        self._poller: asyncio.Task[None] | None = None
        self._started = False
        self._on_change: OnChange = _no_change
        self._on_info: OnChange = _no_change

    @property
    def runners(self) -> tuple[RunnerHandle, ...]:
        return tuple(self._runners)

    def find(self, target: str) -> RunnerHandle | None:
        return next((r for r in self._runners if r.target == target), None)

    def ready(self) -> list[RunnerHandle]:
        return [r for r in self._runners if r.ready]

    def reachable(self) -> list[RunnerHandle]:
        """The runners an operation goes to: reachable and not being detached."""
        return [r for r in self._runners if r.state not in (RunnerState.DISCONNECTED, RunnerState.DETACHING)]

    def max_adapters(self) -> int:
        """The fewest adapters any runner keeps resident (``--max-adapters``); 0 before any reports it."""
        return min((r.info.max_adapters for r in self._runners if r.info is not None and r.info.max_adapters),
                   default=0)

    def describe(self) -> str:
        return ", ".join(r.target for r in self._runners) or "none attached; call AttachRunner"

    # -- following the runners ---------------------------------------------------------------

    def start(self, on_change: OnChange, on_info: OnChange = _no_change) -> None:
        """Starts a Watch per runner and the poller; ``on_change`` hears of every change of a
        runner's state, ``on_info`` of every info the poller read."""
        self._on_change, self._on_info = on_change, on_info
        self._started = True
        for runner in self._runners:
            self._watch(runner)
        self._poller = asyncio.create_task(self._poll(), name="runner info poller")

    def _handle(self, target: str) -> RunnerHandle:
        return RunnerHandle(target, self._settings, listener=self._changed)

    def _changed(self, runner: RunnerHandle) -> None:
        """A handle's listener: the controller hears of it; a suspect runner is probed."""
        if not self._started:
            return
        if runner.state is RunnerState.SUSPECT and runner not in self._probed:
            self._probed.add(runner)
            self._spawn(self._probe(runner), f"probe {runner.target}")
        self._spawn(self._on_change(runner), f"change of {runner.target}")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watch(self, runner: RunnerHandle) -> None:
        self._watches[runner] = asyncio.create_task(self._follow(runner), name=f"watch {runner.target}")

    async def _follow(self, runner: RunnerHandle) -> None:
        """Forever: follows the runner's health; reads its info whenever it is SERVING."""
        while True:
            call = runner.health.Watch(health_pb2.HealthCheckRequest(service=RUNNER_SERVICE))
            try:
                async for response in call:
                    if response.status != SERVING:
                        break  # a draining runner: the stream must close for it to stop; look again shortly
                    reply = await runner.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=INFO_TIMEOUT_S)
                    runner.on_watch(reply.info)
            except grpc.aio.AioRpcError as error:
                logger.debug("runner %s watch ended: %s", runner.target, error.code())
            finally:
                call.cancel()
            runner.on_watch(None)
            await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            for runner in list(self._runners):
                if runner.connected and await self.refresh_info(runner, INFO_TIMEOUT_S):
                    await self._on_info(runner)

    async def refresh_info(self, runner: RunnerHandle, timeout: float) -> bool:
        """Asks the runner for its info now; False when it does not answer."""
        try:
            reply = await runner.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            logger.debug("GetInfo of %s failed: %s", runner.target, error.code())
            return False
        runner.on_poll(reply.info)
        return True

    async def _probe(self, runner: RunnerHandle) -> None:
        """Asks a suspect runner until it answers (then it is trusted again, once a hung one's work has
        ended) or the Watch sees it go."""
        try:
            while runner.state is RunnerState.SUSPECT:
                if not await self.refresh_info(runner, PROBE_TIMEOUT_S) or runner.state is RunnerState.SUSPECT:
                    await asyncio.sleep(PROBE_TIMEOUT_S)
        finally:
            self._probed.discard(runner)

    # -- attaching and detaching -------------------------------------------------------------

    async def attach(self, target: str, timeout: float) -> RunnerHandle:
        """Adds a runner; returns once it is ready (holds the desired state), or removes it and raises."""
        if self.find(target) is not None:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"runner {target} is attached already")
        runner = self._handle(target)
        self._runners.append(runner)
        self._watch(runner)
        logger.info("attaching runner %s", target)
        try:
            try:
                ready = await runner.wait_ready(timeout)
            except TimeoutError:
                why = "still loading" if runner.connected else "not reachable"
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED if runner.connected
                                   else grpc.StatusCode.UNAVAILABLE,
                                   f"runner {target} was not ready within {timeout:.0f} s ({why}); not attached"
                                   ) from None
            if not ready:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"runner {target} could not take the desired state: {runner.refusal}")
        except BaseException:
            await self._remove(runner)
            raise
        logger.info("runner %s attached and ready", target)
        return runner

    async def detach(self, target: str, drain: bool) -> None:
        """Removes a runner: no new work from now; its running batch finishes (drain) or is re-queued."""
        runner = self.find(target)
        if runner is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"runner {target} is not attached")
        runner.detach()
        logger.info("detaching runner %s (%s)", target, "drain" if drain else "re-queueing its work")
        running = runner.running
        for batch in running if not drain else ():
            batch.preempt()
        await asyncio.gather(*(batch.wait(DETACH_TIMEOUT_S) for batch in running))
        await self._remove(runner)
        logger.info("runner %s detached", target)

    async def _remove(self, runner: RunnerHandle) -> None:
        runner.detach()
        await self._on_change(runner)  # the controller stops bringing it to the desired state
        async with self._gate.serialized():  # not in the middle of an operation on it
            if runner in self._runners:
                self._runners.remove(runner)
        await self._close(runner)
        await self._on_change(runner)

    async def _close(self, runner: RunnerHandle) -> None:
        watch = self._watches.pop(runner, None)
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
        await runner.close()

    async def close(self) -> None:
        """Stops following the runners (the controller hears they are detaching) and closes them."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for runner in list(self._runners):
            runner.detach()
            await self._on_change(runner)
            await self._close(runner)
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
