"""Model lifecycle operations against every runner: Init, Sleep, WakeUp, LoadWeights, and bringing a
restarted or newly attached runner to the desired state.

``lock`` serializes the operations and the re-applies. An operation also pauses the dispatcher
and waits until no batch is executing (on any runner), so weights never change under a request;
a re-apply touches one runner that gets no work meanwhile, so the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from diffusion.v1 import common_pb2, runner_pb2

from .errors import RpcFailure
from .lifecycle import Lifecycle
from .runner_client import RunnerClient

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DesiredState:
    """What every runner should hold; re-applied in this order to a restarted or attached runner."""

    model: str
    dtype: int
    # (path, components it changed) of each LoadWeights still in effect, in order.
    weight_updates: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    sleep_level: int = 0
    sleep_tags: list[str] = field(default_factory=list)


async def _call(runner: RunnerClient, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise RpcFailure.from_rpc_error(error, runner.target) from None


class ModelController:
    """Drives the runners' model; ``runners`` is the live list (attach/detach change it in place)."""

    def __init__(self, runners: list[RunnerClient], lifecycle: Lifecycle, model: str, dtype: int) -> None:
        self.runners = runners
        self.lifecycle = lifecycle
        self.lock = asyncio.Lock()
        self.desired = DesiredState(model, dtype) if model else None
        self.on_change: Callable[[], None] = lambda: None  # the dispatcher's wake-up
        self.paused = 0  # operations waiting for or holding exclusive use of the runners
        self.executing = 0  # batches running now, on all runners
        self._executions_done = asyncio.Event()
        self._executions_done.set()

    # -- runners ---------------------------------------------------------------------------

    def start(self) -> None:
        for runner in self.runners:
            runner.start(self.on_runner_change)

    def find(self, target: str) -> RunnerClient | None:
        return next((r for r in self.runners if r.target == target), None)

    def ready_runners(self) -> list[RunnerClient]:
        return [r for r in self.runners if r.ready]

    async def refresh(self) -> None:
        """Publishes runner facts to the lifecycle and wakes the dispatcher."""
        targets = ", ".join(r.target for r in self.runners) or "(none attached; call AttachRunner)"
        await self.lifecycle.update(runner_connected=any(r.ready for r in self.runners), runner_target=targets)
        self.on_change()

    async def on_runner_change(self, runner: RunnerClient) -> None:
        """Watch callback: a runner instance that lacks the desired state gets it."""
        if runner.connected and runner.instance_id != runner.applied_instance and runner in self.runners:
            if runner.apply_task is None or runner.apply_task.done():
                runner.apply_task = asyncio.create_task(self._apply_to(runner), name=f"apply {runner.target}")
        await self.refresh()

    async def _apply_to(self, runner: RunnerClient) -> None:
        """Brings ``runner`` to the desired state, until its instance holds it (or it fails)."""
        while runner.connected and runner.instance_id != runner.applied_instance and runner in self.runners:
            instance = runner.instance_id
            async with self.lock:
                if not runner.connected or runner.instance_id == runner.applied_instance:
                    break  # gone again, or an Init meanwhile brought it to the desired state
                if self.desired is None:
                    runner.applied_instance = instance
                    await self.lifecycle.update(model=None, failure="")
                    break
                alone = not any(r.ready for r in self.runners if r is not runner)
                logger.info("runner %s (instance %s): applying model %s%s", runner.target, instance,
                            self.desired.model, f" and {len(self.desired.weight_updates)} weight update(s)"
                            if self.desired.weight_updates else "")
                try:
                    await self._apply_locked(runner, self.desired, publish=alone, keep_failed=alone)
                except RpcFailure as failure:
                    runner.apply_error = failure.message
                    logger.error("applying model %s to runner %s failed: %s", self.desired.model,
                                 runner.target, failure.message)
                    break  # UNAVAILABLE: tried again when the Watch sees it back; else until the next Init
                runner.apply_error = ""
                logger.info("runner %s ready (instance %s)", runner.target, runner.applied_instance)
            await self.refresh()
        await self.refresh()

    async def _apply_locked(self, runner: RunnerClient, desired: DesiredState, publish: bool = True,
                            keep_failed: bool = True) -> common_pb2.RunnerInfo:
        """LoadModel, then each LoadWeights path, then Sleep. With ``publish``, the worker's state
        is LOADING meanwhile and FAILED on error (the runner is the one that matters). With
        ``keep_failed``, a runner that refused the state (not an unreachable one) still counts as
        holding it: the worker's FAILED state then blocks generation until the next Init."""
        if publish:
            await self.lifecycle.update(loading=desired.model)
        try:
            info = (await _call(runner, runner.stub.LoadModel(
                runner_pb2.LoadModelRequest(source=desired.model, dtype=desired.dtype)))).info
            for path, _ in desired.weight_updates:
                reply = await _call(runner, runner.stub.LoadWeights(
                    runner_pb2.RunnerServiceLoadWeightsRequest(path=path)))
                info.weights_version = reply.weights_version
            if desired.sleep_level:
                info = (await _call(runner, runner.stub.Sleep(runner_pb2.RunnerServiceSleepRequest(
                    level=desired.sleep_level, tags=desired.sleep_tags)))).info
        except RpcFailure as failure:
            refused = failure.code != grpc.StatusCode.UNAVAILABLE
            runner.applied_instance = runner.instance_id if keep_failed and refused else None
            if publish:
                await self.lifecycle.update(loading=None, model=None, weights_version="",
                                            failure=f"loading model {desired.model} failed: {failure.message}")
            raise
        runner.applied_instance = info.instance_id
        runner.info = info  # with the model (the Watch's GetInfo came before it)
        if publish or self.lifecycle.model is None:
            await self.lifecycle.update(loading=None, failure="", model=info.model,
                                        weights_version=info.weights_version,
                                        runner_connected=any(r.ready for r in self.runners))
        return info

    # -- exclusive operations on every runner ----------------------------------------------

    def execution_started(self) -> None:
        self.executing += 1
        self._executions_done.clear()

    def execution_finished(self) -> None:
        self.executing -= 1
        if self.executing == 0:
            self._executions_done.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds ``lock`` with the dispatcher paused and every running batch finished."""
        self.paused += 1
        try:
            async with self.lock:
                await self._executions_done.wait()
                yield
        finally:
            self.paused -= 1
            self.on_change()

    def _targets(self) -> list[RunnerClient]:
        """The runners an operation goes to: every reachable one (the others get it on re-apply)."""
        targets = [r for r in self.runners if r.connected and not r.detaching]
        if not targets:
            names = ", ".join(r.target for r in self.runners) or "none attached"
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"no runner can be reached ({names})")
        return targets

    async def _on_all(self, work: Callable[[RunnerClient], Awaitable[T]]) -> list[tuple[RunnerClient, T]]:
        """Runs ``work`` on every reachable runner at once. A runner that turns out unreachable is
        left for re-apply (when another succeeded); any other failure is raised."""
        targets = self._targets()
        for runner in self.runners:
            if runner not in targets:
                runner.applied_instance = None  # it gets the new desired state when it is back
        results = await asyncio.gather(*(work(r) for r in targets), return_exceptions=True)
        done: list[tuple[RunnerClient, T]] = []
        failures: list[RpcFailure] = []
        for runner, result in zip(targets, results, strict=True):
            if isinstance(result, RpcFailure):
                failures.append(result)
                if result.code == grpc.StatusCode.UNAVAILABLE:
                    runner.applied_instance = None  # re-applied when it is back
            elif isinstance(result, BaseException):
                raise result
            else:
                done.append((runner, result))
        real = [f for f in failures if f.code != grpc.StatusCode.UNAVAILABLE]
        if real or not done:
            raise (real or failures)[0]
        return done

    async def init(self, model: str, dtype: int) -> common_pb2.RunnerInfo:
        """Loads ``model`` on every runner after the requests in flight; forgets the weights loaded before."""
        async with self.exclusive():
            self.desired = DesiredState(model, dtype)
            await self.lifecycle.update(loading=model)
            try:
                done = await self._on_all(lambda r: self._apply_locked(r, self.desired, publish=False))
            except RpcFailure as failure:
                await self.lifecycle.update(loading=None, model=None, weights_version="",
                                            failure=f"loading model {model} failed: {failure.message}")
                raise
            finally:
                await self.refresh()
            info = done[0][1]
            await self.lifecycle.update(loading=None, failure="", model=info.model,
                                        weights_version=info.weights_version)
            await self.refresh()
            return info

    async def sleep(self, level: int, tags: list[str]) -> runner_pb2.RunnerServiceSleepResponse:
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.Sleep(
                runner_pb2.RunnerServiceSleepRequest(level=level, tags=tags))))
            for runner, result in done:
                runner.info = result.info
            reply = done[0][1]
            reply.freed_bytes = sum(d[1].freed_bytes for d in done)
            reply.weight_bytes_released = sum(d[1].weight_bytes_released for d in done)
            if level == 2 and self.desired is not None:
                # Level 2 discards the weights of what it puts to sleep, and with them the weight
                # updates: the runner reloads from the source on wake, so a restarted runner must not
                # get them back either.
                slept = set(tags) or {c.name for c in reply.info.model.components}
                self.desired.weight_updates = [u for u in self.desired.weight_updates if not u[1] & slept]
            await self._record_sleep(reply.info, level)
            return reply

    async def wake_up(self, tags: list[str]) -> runner_pb2.RunnerServiceWakeUpResponse:
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.WakeUp(
                runner_pb2.RunnerServiceWakeUpRequest(tags=tags))))
            for runner, result in done:
                runner.info = result.info
            reply = done[0][1]
            reply.weight_bytes_restored = sum(d[1].weight_bytes_restored for d in done)
            await self._record_sleep(reply.info, self.desired.sleep_level if self.desired else 0)
            return reply

    async def _record_sleep(self, info: common_pb2.RunnerInfo, level: int) -> None:
        await self.lifecycle.update(model=info.model if info.HasField("model") else None)
        asleep = self.lifecycle.sleeping_components
        if self.desired is not None:
            self.desired.sleep_level = level if asleep else 0
            self.desired.sleep_tags = asleep

    async def load_weights(self, path: str) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        """Loads weights on every runner after the requests in flight and remembers ``path`` for re-apply."""
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.LoadWeights(
                runner_pb2.RunnerServiceLoadWeightsRequest(path=path))))
            for runner, result in done:
                if runner.info is not None:
                    runner.info.weights_version = result.weights_version
            reply = done[0][1]
            if self.desired is not None:
                changed = frozenset(name.partition(".")[0] for name in reply.loaded_names)
                self.desired.weight_updates.append((path, changed))
            await self.lifecycle.update(weights_version=reply.weights_version)
            return reply
