"""Model lifecycle operations against the runner: Init, Sleep, WakeUp, LoadWeights, and re-applying
the desired state when the runner restarts. One lock serializes them with request execution."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
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
    """What the runner should hold; re-applied in this order to a restarted runner."""

    model: str
    dtype: int
    weight_paths: list[str] = field(default_factory=list)
    sleep_level: int = 0
    sleep_tags: list[str] = field(default_factory=list)


class ModelController:
    """Drives the runner's model; ``lock`` is held by every operation and by each execution."""

    def __init__(self, runner: RunnerClient, lifecycle: Lifecycle, model: str, dtype: int) -> None:
        self.runner = runner
        self.lifecycle = lifecycle
        self.lock = asyncio.Lock()
        self.desired = DesiredState(model, dtype) if model else None
        self._applied_instance: str | None = None
        self._reapply: asyncio.Task[None] | None = None

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise RpcFailure.from_rpc_error(error, self.runner.target) from None

    async def on_runner_change(self, runner: RunnerClient) -> None:
        """Watch callback: track reachability; a new runner instance gets the desired state."""
        await self.lifecycle.update(runner_connected=runner.connected)
        instance = runner.info.instance_id if runner.info else None
        if instance is None or instance == self._applied_instance:
            return
        if self._applied_instance is not None:
            logger.warning("runner %s restarted (instance %s); re-applying the model", runner.target, instance)
        self._applied_instance = instance
        self._reapply = asyncio.create_task(self._apply_desired())

    async def _apply_desired(self) -> None:
        async with self.lock:
            if self.desired is None:
                await self.lifecycle.update(model=None, failure="")
                return
            try:
                await self._apply_locked(self.desired)
            except RpcFailure as failure:
                logger.error("applying model %s failed: %s", self.desired.model, failure.message)
                if failure.code == grpc.StatusCode.UNAVAILABLE:
                    self._applied_instance = None  # try again when the runner is back

    async def _apply_locked(self, desired: DesiredState) -> common_pb2.RunnerInfo:
        """LoadModel, then each LoadWeights path, then Sleep; LOADING meanwhile, FAILED on error."""
        await self.lifecycle.update(loading=desired.model)
        try:
            info = (await self._call(self.runner.stub.LoadModel(
                runner_pb2.LoadModelRequest(source=desired.model, dtype=desired.dtype)))).info
            self._applied_instance = info.instance_id
            for path in desired.weight_paths:
                reply = await self._call(self.runner.stub.LoadWeights(
                    runner_pb2.RunnerServiceLoadWeightsRequest(path=path)))
                info.weights_version = reply.weights_version
            if desired.sleep_level:
                info = (await self._call(self.runner.stub.Sleep(runner_pb2.RunnerServiceSleepRequest(
                    level=desired.sleep_level, tags=desired.sleep_tags)))).info
        except RpcFailure as failure:
            await self.lifecycle.update(loading=None, model=None, weights_version="",
                                        failure=f"loading model {desired.model} failed: {failure.message}")
            raise
        await self.lifecycle.update(loading=None, failure="", model=info.model,
                                    weights_version=info.weights_version)
        return info

    async def init(self, model: str, dtype: int) -> common_pb2.RunnerInfo:
        """Loads ``model`` after the request in flight; forgets the weights loaded before."""
        async with self.lock:
            self.desired = DesiredState(model, dtype)
            return await self._apply_locked(self.desired)

    async def sleep(self, level: int, tags: list[str]) -> runner_pb2.RunnerServiceSleepResponse:
        async with self.lock:
            reply = await self._call(self.runner.stub.Sleep(
                runner_pb2.RunnerServiceSleepRequest(level=level, tags=tags)))
            await self._record_sleep(reply.info, level)
            return reply

    async def wake_up(self, tags: list[str]) -> runner_pb2.RunnerServiceWakeUpResponse:
        async with self.lock:
            return await self.wake_up_locked(tags)

    async def wake_up_locked(self, tags: list[str]) -> runner_pb2.RunnerServiceWakeUpResponse:
        """WakeUp for a caller that holds ``lock`` (the dispatcher, with --auto-wake)."""
        reply = await self._call(self.runner.stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest(tags=tags)))
        await self._record_sleep(reply.info, self.desired.sleep_level if self.desired else 0)
        return reply

    async def _record_sleep(self, info: common_pb2.RunnerInfo, level: int) -> None:
        await self.lifecycle.update(model=info.model if info.HasField("model") else None)
        asleep = self.lifecycle.sleeping_components
        if self.desired is not None:
            self.desired.sleep_level = level if asleep else 0
            self.desired.sleep_tags = asleep

    async def load_weights(self, path: str) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        """Loads weights after the request in flight and remembers ``path`` for re-apply."""
        async with self.lock:
            reply = await self._call(self.runner.stub.LoadWeights(
                runner_pb2.RunnerServiceLoadWeightsRequest(path=path)))
            if self.desired is not None:
                self.desired.weight_paths.append(path)
            await self.lifecycle.update(weights_version=reply.weights_version)
            return reply
