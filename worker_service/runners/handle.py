"""One runner as the worker sees it: the channel and stubs, and the runner handle's state.

The handle is the one owner of every fact about its runner. Its state changes only through its
own methods, each called by the part that learns the fact:

- the pool's health Watch and GetInfo poller (``on_watch``, ``on_poll``): reachable or not, and
  which process (instance) answers; a new instance counts as a restart;
- the controller bringing it to the desired state (``apply_begun``, ``applied``,
  ``apply_refused``), or an operation that changed the desired state without it (``missed``);
- whoever called it and failed (``on_call_outcome``, or ``call``, which awaits a call and tells
  it), which sorts the failure for everyone: unreachable (suspect), outcome unknown (the desired
  state is applied again), or refused;
- the dispatcher starting and ending batches on it (``batch_started``, ``batch_ended``): the
  handle is the one record of what runs on it, which the dispatcher's plans and the status read;
- the pool detaching it (``detach``).

Every change of state is told to the ``listener``: the pool, which probes a
suspect runner and tells the controller.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES, message_options
from serving_common.errors import ServiceError

if TYPE_CHECKING:
    from worker_service.scheduling.jobs import Job

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A runner that died comes back in seconds; gRPC's default reconnect backoff grows to minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# RunnerInfo.step_schedule of a runner whose step batch's size groups take turns by compute.
BUDGET_STEP_SCHEDULE = "budget"

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
    """A batch a runner executes, as its handle keeps it: what it runs, and how the pool detaches it."""

    @property
    def jobs(self) -> Sequence[Job]:
        """The requests it runs."""

    @property
    def images(self) -> int:
        """The images it generates, as the runner's room counts them (a video fills it)."""

    def preempt(self) -> None:
        """Stops the batch now; its requests go back to the queue."""

    async def wait(self, timeout: float) -> None:
        """Returns when the batch has ended, or after ``timeout`` seconds."""


class RunnerState(enum.Enum):
    DISCONNECTED = "disconnected"  # the health Watch does not see it serving
    CONNECTED = "connected"  # reachable, not holding the desired state (yet)
    APPLYING = "applying"  # being brought to the desired state
    READY = "ready"  # holds the desired state: it may get work
    REFUSED = "refused"  # this instance refused the desired state; so until an operation or a new instance
    SUSPECT = "suspect"  # a call found it unreachable or hung; no work until it answers again (and, hung, idle)
    DETACHING = "detaching"  # leaving the pool: no new work


class CallOutcome(enum.Enum):
    """How a call to a runner ended, as it matters to the runner's state."""

    OK = "ok"
    LOST = "lost"  # unreachable or hung: the runner is suspect
    UNKNOWN = "unknown"  # a state-changing call that may still run there: the desired state is applied again
    FAILED = "failed"  # the runner answered with an error: nothing changed


def _no_listener(runner: RunnerHandle) -> None:
    return None


class RunnerHandle:
    """The handle of one runner: ``stub`` for its RPCs; ``state`` says whether it may get work."""

    def __init__(self, target: str, settings: ChannelSettings,
                 listener: Callable[[RunnerHandle], None] = _no_listener) -> None:
        self.target = target
        self.channel = settings.open(target)
        self.stub = runner_pb2_grpc.RunnerServiceStub(self.channel)
        # PushWeights with requests already serialized: the worker relays and keeps the bytes it
        # received without building each message again.
        self.push_serialized: PushSerialized = self.channel.stream_unary(
            "/diffusion.v1.RunnerService/PushWeights", request_serializer=None,
            response_deserializer=runner_pb2.RunnerServicePushWeightsResponse.FromString)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._listener = listener
        self._connected = False
        self._info: common_pb2.RunnerInfo | None = None
        self._last_instance: str | None = None  # kept while unreachable, to count restarts
        self._restarts = 0
        self._suspect = False
        self._stalled_at: float | None = None  # when a call saw it make no progress (``stalled``)
        self._detaching = False
        self._applying = False
        self._held: str | None = None  # the instance that holds the desired state
        self._refusal = ""  # why this instance refused the desired state
        self._running: list[RunningBatch] = []
        self._batches = 0
        self._state = RunnerState.DISCONNECTED
        self._moved = asyncio.Event()  # set, and replaced, at each change of state

    # -- what it is ------------------------------------------------------------------------

    @property
    def state(self) -> RunnerState:
        return self._state

    @property
    def connected(self) -> bool:
        """Its health Watch (or a GetInfo) found it serving."""
        return self._connected

    @property
    def ready(self) -> bool:
        return self._state is RunnerState.READY

    @property
    def info(self) -> common_pb2.RunnerInfo | None:
        """What it last reported while reachable."""
        return self._info

    @property
    def instance_id(self) -> str | None:
        return self._info.instance_id if self._info else None

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def refusal(self) -> str:
        """Why it refused the desired state (REFUSED)."""
        return self._refusal

    @property
    def running(self) -> tuple[RunningBatch, ...]:
        """The batches it executes now: one at most, unless its model batches at steps."""
        return tuple(self._running)

    @property
    def running_jobs(self) -> tuple[Job, ...]:
        """The requests of the batches it executes now."""
        return tuple(job for batch in self._running for job in batch.jobs)

    @property
    def in_flight(self) -> int:
        """Requests running on it now."""
        return sum(len(batch.jobs) for batch in self._running)

    @property
    def batches(self) -> int:
        """Batches started on it so far."""
        return self._batches

    @property
    def step_batching(self) -> bool:
        """Its model's requests join a running batch at step boundaries: several Executes may run."""
        return bool(self._info and self._info.HasField("model") and self._info.model.capabilities.step_batching)

    @property
    def stepped_tasks(self) -> frozenset[int]:
        """The tasks whose requests join its model's running batch at step boundaries."""
        if self._info is None or not self._info.HasField("model"):
            return frozenset()
        return frozenset(self._info.model.capabilities.step_batching_tasks)

    @property
    def takes_turns(self) -> bool:
        """Its step batch's size groups take turns by compute (its --step-schedule budget): the worker
        then schedules by compute too (``scheduling.plan``)."""
        return bool(self._info and self._info.step_schedule == BUDGET_STEP_SCHEDULE)

    def room(self, max_images: int) -> int:
        """Images it may be sent now: none while not ready; with step-level batching, what
        ``max_images`` leaves beside the images running; else all, once its batch is done."""
        if not self.ready:
            return 0
        if self.step_batching:
            return max(max_images - sum(batch.images for batch in self._running), 0)
        return 0 if self._running else max_images

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until it is READY (True) or REFUSED the desired state (False); TimeoutError after
        ``timeout`` seconds."""
        async def settled() -> None:
            while self._state not in (RunnerState.READY, RunnerState.REFUSED):
                await self._moved.wait()

        async with asyncio.timeout(timeout):
            await settled()
        return self._state is RunnerState.READY

    # -- reachability: the pool's Watch and GetInfo --------------------------------------------

    def on_watch(self, info: common_pb2.RunnerInfo | None) -> None:
        """The health Watch saw it serving, with the info read then; or (None) saw it go."""
        if info is not None:
            self._seen(info)
        else:
            if self._connected:
                logger.info("runner %s not reachable", self.target)
            self._connected, self._info = False, None
            self._suspect = self._applying = False  # it must come back through the Watch
            self._stalled_at = None
        self._update()

    def on_poll(self, info: common_pb2.RunnerInfo) -> None:
        """A GetInfo answered (the poller, a probe, a refresh): reachable, and trusted again."""
        self._seen(info)
        self._update()

    def _seen(self, info: common_pb2.RunnerInfo) -> None:
        if not self._connected:
            logger.info("runner %s connected", self.target)
        if info.instance_id != self._last_instance:
            if self._last_instance is not None:
                self._restarts += 1
                logger.warning("runner %s is a new process (instance %s, restart %d)", self.target,
                               info.instance_id, self._restarts)
            self._last_instance = info.instance_id
            self._refusal, self._stalled_at = "", None
        if self._stalled_at is not None and info.device_busy_s < time.monotonic() - self._stalled_at:
            logger.info("runner %s: the work it was stuck in has ended", self.target)
            self._stalled_at = None  # its device is idle, or busy with work begun since
        self._connected, self._info = True, info
        self._suspect = self._stalled_at is not None

    # -- what it holds: the controller's operations ---------------------------------------------

    def on_reply(self, info: common_pb2.RunnerInfo) -> None:
        """An operation's reply carried its info (the model, what is asleep, the adapters)."""
        self._info = info
        self._update()

    def weights_changed(self, version: str, checksum: str | None = None) -> None:
        """A LoadWeights or PushWeights set its weights version (and, when given, their checksum)."""
        if self._info is not None:
            self._info.weights_version = version
            if checksum is not None:
                self._info.weights_checksum = checksum

    def checksum_computed(self, version: str, checksum: str) -> None:
        """It computed ``checksum`` for the weights of ``version``."""
        if self._info is not None and self._info.weights_version == version:
            self._info.weights_checksum = checksum

    def apply_begun(self) -> None:
        self._applying, self._refusal = True, ""
        self._update()

    def applied(self, info: common_pb2.RunnerInfo | None = None) -> None:
        """It holds the desired state now; ``info``: what it reported at the end."""
        if info is not None:
            self._info = info
        self._held, self._applying, self._refusal = self.instance_id, False, ""
        self._update()

    def apply_refused(self, reason: str) -> None:
        """It answered that it cannot take the desired state: no work until an operation or a new
        instance brings it there."""
        self._held, self._applying, self._refusal = None, False, reason
        self._update()

    def missed(self) -> None:
        """The desired state changed without it: it gets it again when it may."""
        self._held = None
        self._update()

    def on_call_outcome(self, status: grpc.StatusCode, changes_state: bool = False) -> CallOutcome:
        """Sorts how a call to it ended (``changes_state``: the call changes what it holds).

        UNAVAILABLE (and CANCELLED, for a call that changes nothing) is LOST: it is suspect, and
        gets no work until it answers again or its Watch sees it go. DEADLINE_EXCEEDED or CANCELLED
        of a call that changes its state is UNKNOWN: the call may still run there, so it no longer
        counts as holding the desired state. Any other error is FAILED: it answered; nothing changed.
        OK: it answered, so it is trusted again."""
        if status == grpc.StatusCode.OK:
            self._suspect, outcome = self._stalled_at is not None, CallOutcome.OK
        elif status == grpc.StatusCode.UNAVAILABLE or (status == grpc.StatusCode.CANCELLED and not changes_state):
            self._suspect, outcome = self._connected, CallOutcome.LOST
        elif changes_state and status in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            outcome = CallOutcome.UNKNOWN
            logger.warning("runner %s: the outcome of an operation is unknown; re-applying the desired state",
                           self.target)
        else:
            outcome = CallOutcome.FAILED
        if changes_state and outcome in (CallOutcome.LOST, CallOutcome.UNKNOWN):
            self._held, self._applying = None, False
        self._update()
        return outcome

    def stalled(self) -> None:
        """An Execute on it showed no progress for longer than a step can take: suspect (no work,
        not ready) until it reports that the work it was stuck in has ended (``device_busy_s``
        shorter than the time since), restarts or goes; never handed its batch again meanwhile."""
        self._stalled_at = time.monotonic()
        self.on_call_outcome(grpc.StatusCode.UNAVAILABLE)

    async def call(self, call: Awaitable[T], changes_state: bool = True) -> T:
        """Awaits ``call`` to this runner; a failure is sorted (``on_call_outcome``), then raised as a
        ServiceError naming the runner."""
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            self.on_call_outcome(error.code(), changes_state)
            raise ServiceError.from_rpc_error(error, self.target) from None

    # -- its work: the dispatcher's batches, the pool's detach ---------------------------------

    def batch_started(self, batch: RunningBatch) -> None:
        self._running.append(batch)
        self._batches += 1

    def batch_ended(self, batch: RunningBatch) -> None:
        if batch in self._running:
            self._running.remove(batch)

    def detach(self) -> None:
        self._detaching = True
        self._update()

    async def close(self) -> None:
        await self.channel.close()

    # -- telling the listener ------------------------------------------------------------------

    def _derive(self) -> RunnerState:
        if self._detaching:
            return RunnerState.DETACHING
        if not self._connected:
            return RunnerState.DISCONNECTED
        if self._suspect:
            return RunnerState.SUSPECT
        if self._applying:
            return RunnerState.APPLYING
        if self._refusal:
            return RunnerState.REFUSED
        if self._held is not None and self._held == self.instance_id:
            return RunnerState.READY
        return RunnerState.CONNECTED

    def _update(self) -> None:
        state = self._derive()
        if state is self._state:
            return
        logger.debug("runner %s: %s (instance %s)", self.target, state.value, self.instance_id)
        self._state = state
        self._moved.set()
        self._moved = asyncio.Event()
        self._listener(self)
