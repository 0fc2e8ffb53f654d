"""The channel and stubs to one runner, and a health Watch that tracks whether it is reachable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.rpc import SERVING, channel_options
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc

logger = logging.getLogger(__name__)

RUNNER_SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"].full_name
RECONNECT_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 5.0


class RunnerClient:
    """One runner: ``stub`` for its RPCs, ``connected`` and ``info`` kept fresh by ``watch``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=channel_options())
        self.stub = runner_pb2_grpc.RunnerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.connected = False
        self.info: common_pb2.RunnerInfo | None = None

    async def watch(self, on_change: Callable[[RunnerClient], Awaitable[None]]) -> None:
        """Follows the runner's health forever; calls ``on_change`` whenever reachability or info changes."""
        while True:
            call = self._health.Watch(health_pb2.HealthCheckRequest(service=RUNNER_SERVICE))
            try:
                async for response in call:
                    if response.status != SERVING:
                        break  # a draining runner: the stream must close for it to stop; look again shortly
                    reply = await self.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=INFO_TIMEOUT_S)
                    await self._set(True, reply.info, on_change)
            except grpc.aio.AioRpcError as error:
                logger.debug("runner %s watch ended: %s", self.target, error.code())
            finally:
                call.cancel()
            await self._set(False, None, on_change)
            await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _set(self, connected: bool, info: common_pb2.RunnerInfo | None,
                   on_change: Callable[[RunnerClient], Awaitable[None]]) -> None:
        if connected != self.connected:
            logger.info("runner %s %s", self.target, "connected" if connected else "not reachable")
        changed = connected != self.connected or info != self.info
        self.connected, self.info = connected, info
        if changed:
            await on_change(self)

    async def close(self) -> None:
        await self.channel.close()
