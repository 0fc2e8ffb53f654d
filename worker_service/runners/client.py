"""One runner as the worker sees it: the channel and stubs, and the facts kept about it.

Each fact has one writer. The ``RunnerPool`` writes reachability (``connected``, ``info``,
``restarts``, ``suspect``, ``detaching``); the ``ModelController`` writes what the runner holds
(``applied_instance``, ``apply_error``) and refreshes ``info`` after an operation; the
``Dispatcher`` writes ``running`` and ``batches``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES, message_options

# A runner that died comes back in seconds; gRPC's default reconnect backoff grows to minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# PushWeights taking requests already serialized.
PushSerialized = grpc.aio.StreamUnaryMultiCallable[bytes, runner_pb2.RunnerServicePushWeightsResponse]


@dataclass(frozen=True)
class ChannelSettings:
    """How every runner channel is opened: interceptors (token, request ids) and the message limit."""

    interceptors: tuple[grpc.aio.ClientInterceptor, ...] = ()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    options: tuple[tuple[str, int], ...] = field(default_factory=lambda: tuple(RECONNECT_OPTIONS))

    def open(self, target: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target, options=[*message_options(self.max_message_bytes), *self.options],
                                         interceptors=list(self.interceptors))


class RunningBatch(Protocol):
    """What the pool needs of a batch a runner executes, to detach it."""

    @property
    def images(self) -> int:
        """The images it generates."""

    def preempt(self) -> None:
        """Stops the batch now; its requests go back to the queue."""

    async def wait(self, timeout: float) -> None:
        """Returns when the batch has ended, or after ``timeout`` seconds."""


class RunnerClient:
    """One runner: ``stub`` for its RPCs; ``ready`` when it may get work now."""

    def __init__(self, target: str, settings: ChannelSettings) -> None:
        self.target = target
        self.channel = settings.open(target)
        self.stub = runner_pb2_grpc.RunnerServiceStub(self.channel)
        # PushWeights with requests already serialized: the worker relays and keeps the bytes it
        # received without building each message again.
        self.push_serialized: PushSerialized = self.channel.stream_unary(
            "/diffusion.v1.RunnerService/PushWeights", request_serializer=None,
            response_deserializer=runner_pb2.RunnerServicePushWeightsResponse.FromString)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        # Written by the pool.
        self.connected = False
        self.info: common_pb2.RunnerInfo | None = None
        self.last_instance: str | None = None  # kept while unreachable, to count restarts
        self.restarts = 0
        self.suspect = False  # an RPC found it unreachable before the Watch noticed
        self.detaching = False
        # Written by the controller: the runner process that holds the worker's desired state.
        self.applied_instance: str | None = None
        self.apply_error = ""
        self.apply_task: asyncio.Task[None] | None = None
        # Written by the dispatcher.
        self.running: list[RunningBatch] = []  # one at most, unless the runner batches at steps
        self.batches = 0

    @property
    def instance_id(self) -> str | None:
        return self.info.instance_id if self.info else None

    @property
    def ready(self) -> bool:
        """Reachable, holding the desired state, not being detached and not suspected dead."""
        return (self.connected and not self.detaching and not self.suspect
                and self.instance_id is not None and self.applied_instance == self.instance_id)

    @property
    def step_batching(self) -> bool:
        """Its model's requests join a running batch at step boundaries: several Executes may run."""
        return bool(self.info and self.info.HasField("model") and self.info.model.capabilities.step_batching)

    def room(self, max_images: int) -> int:
        """Images it may be sent now: none while not ready; with step-level batching, what
        ``max_images`` leaves beside the images running; else all, once its batch is done."""
        if not self.ready:
            return 0
        if self.step_batching:
            return max(max_images - sum(batch.images for batch in self.running), 0)
        return 0 if self.running else max_images
