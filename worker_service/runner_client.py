"""The channel and stubs to one runner, a health Watch that tracks whether it is reachable and
which process (instance id) it is, and the facts the dispatcher needs about it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.rpc import DEFAULT_MAX_MESSAGE_BYTES, SERVING, channel_options
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc

logger = logging.getLogger(__name__)

RUNNER_SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"].full_name
RECONNECT_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 1.0
# A runner that died comes back in seconds; gRPC's default reconnect backoff grows to minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

OnChange = Callable[["RunnerClient"], Awaitable[None]]


class RunnerClient:
    """One runner: ``stub`` for its RPCs, ``connected`` and ``info`` kept fresh by ``watch``.

    ``applied_instance`` is the runner process that holds the worker's desired state (set by the
    controller); ``ready`` means it may get work now. ``running`` is the batch it executes (the
    scheduler's), ``suspect`` is set when an RPC found it unreachable before the Watch noticed.
    """

    # Set once by main before any runner is attached: the runner token (clients.auth) and the
    # x-request-id interceptors, and the message size limit.
    channel_interceptors: ClassVar[list[grpc.aio.ClientInterceptor]] = []
    max_message_bytes: ClassVar[int] = DEFAULT_MAX_MESSAGE_BYTES

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(
            target, options=channel_options(self.max_message_bytes) + RECONNECT_OPTIONS,
            interceptors=list(self.channel_interceptors))
        self.stub = runner_pb2_grpc.RunnerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.connected = False
        self.info: common_pb2.RunnerInfo | None = None
        self.last_instance: str | None = None
        self.restarts = 0
        self.applied_instance: str | None = None
        self.apply_error = ""
        self.detaching = False
        self.suspect = False
        self.running: object | None = None
        self.batches = 0
        self.watch_task: asyncio.Task[None] | None = None
        self.apply_task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str | None:
        return self.info.instance_id if self.info else None

    @property
    def ready(self) -> bool:
        """Reachable, holding the desired state, not being detached and not suspected dead."""
        return (self.connected and not self.detaching and not self.suspect
                and self.instance_id is not None and self.applied_instance == self.instance_id)

    def start(self, on_change: OnChange) -> None:
        self.watch_task = asyncio.create_task(self.watch(on_change), name=f"watch {self.target}")

    async def watch(self, on_change: OnChange) -> None:
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

    async def probe(self, on_change: OnChange) -> None:
        """After an RPC found the runner unreachable: asks it directly instead of waiting for the Watch."""
        try:
            reply = await self.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return  # really gone: the Watch ends and reports it
        self.suspect = False
        await self._set(True, reply.info, on_change, force=True)

    async def _set(self, connected: bool, info: common_pb2.RunnerInfo | None, on_change: OnChange,
                   force: bool = False) -> None:
        if connected != self.connected:
            logger.info("runner %s %s", self.target, "connected" if connected else "not reachable")
        if not connected:
            self.suspect = False  # the Watch saw it go; it must come back through the Watch
        if info is not None and info.instance_id != self.last_instance:
            if self.last_instance is not None:
                self.restarts += 1
                logger.warning("runner %s is a new process (instance %s, restart %d)", self.target,
                               info.instance_id, self.restarts)
            self.last_instance = info.instance_id
        changed = force or connected != self.connected or info != self.info
        self.connected, self.info = connected, info
        if changed:
            await on_change(self)

    async def close(self) -> None:
        for task in (self.watch_task, self.apply_task):
            if task is not None and not task.done():
                task.cancel()
        for task in (self.watch_task, self.apply_task):
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing regardless
                    pass
        await self.channel.close()
