"""The runners the worker serves with: the list, their health Watch, one GetInfo poller, attach and detach.

The pool is the one owner of the runner list and of every runner's reachability. A Watch per
runner follows its health and reads ``GetInfo`` whenever it (re)appears, so a restart shows as a
new instance id; the poller refreshes ``info`` (memory, state) every ``poll_interval`` seconds for
metrics and status. ``on_change(runner)`` is called whenever a runner's reachability or instance
changes; the controller passes it at ``start`` to re-apply its desired state.

``lock`` gives exclusive use of the runners: lifecycle operations hold it, and a runner leaves
the list only under it, never in the middle of an operation on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2

from diffusion.v1 import common_pb2, runner_pb2
from serving_common.errors import ServiceError
from serving_common.protocol import RUNNER_SERVICE
from serving_common.server import SERVING
from worker_service.runners.client import ChannelSettings, RunnerClient

logger = logging.getLogger(__name__)

OnChange = Callable[[RunnerClient], Awaitable[None]]  # also the type of on_info
RECONNECT_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 1.0
POLL_INTERVAL_S = 5.0
DETACH_TIMEOUT_S = 60.0
ATTACH_POLL_S = 0.05


async def _no_change(runner: RunnerClient) -> None:
    return None


class RunnerPool:
    def __init__(self, targets: Iterable[str], settings: ChannelSettings,
                 poll_interval: float = POLL_INTERVAL_S) -> None:
        self._settings = settings
        self._poll_interval = poll_interval
        self._runners = [RunnerClient(target, settings) for target in targets]
        self._tasks: dict[RunnerClient, asyncio.Task[None]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._on_change: OnChange = _no_change
        self._on_info: OnChange = _no_change
        self.lock = asyncio.Lock()

    @property
    def runners(self) -> tuple[RunnerClient, ...]:
        return tuple(self._runners)

    def find(self, target: str) -> RunnerClient | None:
        return next((r for r in self._runners if r.target == target), None)

    def ready(self) -> list[RunnerClient]:
        return [r for r in self._runners if r.ready]

    def reachable(self) -> list[RunnerClient]:
        """The runners an operation goes to: reachable and not being detached."""
        return [r for r in self._runners if r.connected and not r.detaching]

    def max_adapters(self) -> int:
        """The fewest adapters any runner keeps resident (``--max-adapters``); 0 before any reports it."""
        return min((r.info.max_adapters for r in self._runners if r.info is not None and r.info.max_adapters),
                   default=0)

    def describe(self) -> str:
        return ", ".join(r.target for r in self._runners) or "none attached; call AttachRunner"

    # -- following the runners ---------------------------------------------------------------

    def start(self, on_change: OnChange, on_info: OnChange = _no_change) -> None:
        """Starts a Watch per runner and the poller; ``on_change`` hears of every change of a
        runner's reachability or instance, ``on_info`` of every info the poller read."""
        self._on_change, self._on_info = on_change, on_info
        for runner in self._runners:
            self._watch(runner)
        self._poller = asyncio.create_task(self._poll(), name="runner info poller")

    def _watch(self, runner: RunnerClient) -> None:
        self._tasks[runner] = asyncio.create_task(self._follow(runner), name=f"watch {runner.target}")

    async def _follow(self, runner: RunnerClient) -> None:
        """Forever: follows the runner's health; reads its info whenever it is SERVING."""
        while True:
            call = runner.health.Watch(health_pb2.HealthCheckRequest(service=RUNNER_SERVICE))
            try:
                async for response in call:
                    if response.status != SERVING:
                        break  # a draining runner: the stream must close for it to stop; look again shortly
                    reply = await runner.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=INFO_TIMEOUT_S)
                    await self._set(runner, True, reply.info)
            except grpc.aio.AioRpcError as error:
                logger.debug("runner %s watch ended: %s", runner.target, error.code())
            finally:
                call.cancel()
            await self._set(runner, False, None)
            await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            for runner in list(self._runners):
                if runner.connected and await self.refresh_info(runner, INFO_TIMEOUT_S):
                    await self._on_info(runner)

    async def refresh_info(self, runner: RunnerClient, timeout: float) -> bool:
        """Asks the runner for its info now; False when it does not answer."""
        try:
            reply = await runner.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            logger.debug("GetInfo of %s failed: %s", runner.target, error.code())
            return False
        await self._set(runner, True, reply.info)
        return True

    def suspect(self, runner: RunnerClient) -> None:
        """An RPC found ``runner`` unreachable or hung: no new work until it answers again (or the
        Watch ends)."""
        runner.suspect = True
        asyncio.create_task(self._probe(runner), name=f"probe {runner.target}")

    async def _probe(self, runner: RunnerClient) -> None:
        """Asks a suspect runner until it answers (then it is trusted again) or the Watch sees it go."""
        await self._on_change(runner)  # not ready now: readiness follows at once
        while runner.suspect and runner in self._runners:
            if await self.refresh_info(runner, PROBE_TIMEOUT_S):
                runner.suspect = False
                await self._on_change(runner)
                return
            await asyncio.sleep(PROBE_TIMEOUT_S)

    async def _set(self, runner: RunnerClient, connected: bool, info: common_pb2.RunnerInfo | None) -> None:
        if connected != runner.connected:
            logger.info("runner %s %s", runner.target, "connected" if connected else "not reachable")
        if not connected:
            runner.suspect = False  # the Watch saw it go; it must come back through the Watch
        previous = runner.last_instance
        if info is not None and info.instance_id != previous:
            if previous is not None:
                runner.restarts += 1
                logger.warning("runner %s is a new process (instance %s, restart %d)", runner.target,
                               info.instance_id, runner.restarts)
            runner.last_instance = info.instance_id
        changed = connected != runner.connected or runner.instance_id != (info.instance_id if info else None)
        runner.connected, runner.info = connected, info
        if changed:
            await self._on_change(runner)

    # -- attaching and detaching -------------------------------------------------------------

    async def attach(self, target: str, timeout: float) -> RunnerClient:
        """Adds a runner; returns once it is ready (holds the desired state), or removes it and raises."""
        if self.find(target) is not None:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"runner {target} is attached already")
        runner = RunnerClient(target, self._settings)
        self._runners.append(runner)
        self._watch(runner)
        logger.info("attaching runner %s", target)
        deadline = time.monotonic() + timeout
        try:
            while not runner.ready:
                if runner.apply_error and runner.apply_task is not None and runner.apply_task.done():
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"runner {target} could not take the desired state: {runner.apply_error}")
                if time.monotonic() >= deadline:
                    why = "still loading" if runner.connected else "not reachable"
                    raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED if runner.connected
                                       else grpc.StatusCode.UNAVAILABLE,
                                       f"runner {target} was not ready within {timeout:.0f} s ({why}); not attached")
                await asyncio.sleep(ATTACH_POLL_S)
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
        runner.detaching = True
        logger.info("detaching runner %s (%s)", target, "drain" if drain else "re-queueing its work")
        running = list(runner.running)
        for batch in running if not drain else []:
            batch.preempt()
        await asyncio.gather(*(batch.wait(DETACH_TIMEOUT_S) for batch in running))
        await self._remove(runner)
        logger.info("runner %s detached", target)

    async def _remove(self, runner: RunnerClient) -> None:
        async with self.lock:  # not in the middle of an operation on it
            if runner in self._runners:
                self._runners.remove(runner)
        await self._close(runner)
        await self._on_change(runner)

    async def _close(self, runner: RunnerClient) -> None:
        tasks = [t for t in (self._tasks.pop(runner, None), runner.apply_task) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await runner.channel.close()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for runner in list(self._runners):
            await self._close(runner)
