"""The worker's lifecycle state, published to GetStatus and health.

STARTING: no runner reachable yet, or no model. LOADING: Init in progress. READY. SLEEPING: some
component asleep. FAILED: the last Init (or re-apply, with no other runner) failed. DRAINING:
shutting down. Readiness (health of ``diffusion.v1.WorkerService``) is SERVING only in READY;
``""`` stays SERVING while alive.

The model, what is asleep and the weights version are read, when asked, from a runner that holds
the desired state (the runners' handles own those facts); the lifecycle's own facts are the
operation in progress (``loading``), its failure, and draining.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.errors import ServiceError, failed_precondition, unavailable
from serving_common.protocol import WORKER_SERVICE
from serving_common.server import NOT_SERVING, SERVING
from worker_service.desired_state import DesiredState
from worker_service.runners import RunnerPool
from worker_service.runners.handle import RunnerState

logger = logging.getLogger(__name__)


class Lifecycle:
    """``state`` and readiness follow from the runners' handles, the desired state and the facts below,
    which change only through the setters, each of which publishes the new state."""

    def __init__(self, health_servicer: health.aio.HealthServicer, pool: RunnerPool,
                 desired: Callable[[], DesiredState | None]) -> None:
        self._health = health_servicer
        self._pool = pool
        self._desired = desired
        self.loading: str | None = None
        self.failure = ""
        self.draining = False
        self._published: tuple[int, str] | None = None

    # -- derived from the handles and the desired state ------------------------------------------

    @property
    def runner_targets(self) -> str:
        return self._pool.describe()

    @property
    def runner_ready(self) -> bool:
        """Some runner holds the desired state, or (with a failure) answered that it cannot."""
        states = {r.state for r in self._pool.runners}
        return RunnerState.READY in states or bool(self.failure and RunnerState.REFUSED in states)

    def _served(self) -> common_pb2.RunnerInfo | None:
        """The info of a runner that holds the desired model; None without one (or after a failure)."""
        if self._desired() is None or self.failure:
            return None
        return next((r.info for r in self._pool.ready() if r.info is not None and r.info.HasField("model")), None)

    @property
    def model(self) -> common_pb2.ModelInfo | None:
        served = self._served()
        return served.model if served is not None else None

    @property
    def weights_version(self) -> str:
        served = self._served()
        return served.weights_version if served is not None else ""

    @property
    def sleeping_components(self) -> list[str]:
        model = self.model
        return [c.name for c in model.components if c.asleep] if model is not None else []

    @property
    def sleep_level(self) -> int:
        model = self.model
        return model.sleep_level if model is not None and any(c.asleep for c in model.components) else 0

    @property
    def state(self) -> worker_pb2.WorkerState:
        if self.draining:
            return worker_pb2.WORKER_STATE_DRAINING
        if self.loading is not None:
            return worker_pb2.WORKER_STATE_LOADING
        if not self.runner_ready:
            return worker_pb2.WORKER_STATE_STARTING
        if self.failure:
            return worker_pb2.WORKER_STATE_FAILED
        if self.model is None:
            return worker_pb2.WORKER_STATE_STARTING
        if self.sleeping_components:
            return worker_pb2.WORKER_STATE_SLEEPING
        return worker_pb2.WORKER_STATE_READY

    @property
    def message(self) -> str:
        state = self.state
        if state == worker_pb2.WORKER_STATE_DRAINING:
            return "worker is draining"
        if state == worker_pb2.WORKER_STATE_LOADING:
            return f"loading model {self.loading}"
        if state == worker_pb2.WORKER_STATE_FAILED:
            return self.failure
        if state == worker_pb2.WORKER_STATE_STARTING:
            if not self.runner_ready:
                return f"waiting for a ready runner ({self.runner_targets})"
            return "no model loaded; call Init"
        if state == worker_pb2.WORKER_STATE_SLEEPING:
            return (f"model is asleep (level {self.sleep_level}): "
                    f"{', '.join(self.sleeping_components)}; call WakeUp")
        return ""

    def generation_blocker(self, auto_wake: bool) -> ServiceError | None:
        """Why a request cannot run now (draining aside), or None; a sleeping model is fine with auto-wake."""
        state = self.state
        if state == worker_pb2.WORKER_STATE_READY:
            return None
        if state == worker_pb2.WORKER_STATE_SLEEPING:
            return None if auto_wake else failed_precondition("model is asleep; call WakeUp")
        if not self.runner_ready and state != worker_pb2.WORKER_STATE_LOADING:
            return unavailable(f"no runner is ready ({self.runner_targets})")
        return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"worker is not ready: {self.message}")

    # -- setters -------------------------------------------------------------------------------

    async def begin_loading(self, model: str) -> None:
        self.loading = model
        await self.publish()

    async def loaded(self) -> None:
        """The desired state is served (or, without a model, known to be empty); any failure is cleared."""
        self.loading, self.failure = None, ""
        await self.publish()

    async def load_failed(self, failure: str) -> None:
        self.loading, self.failure = None, failure
        await self.publish()

    async def start_draining(self) -> None:
        self.draining = True
        await self.publish()

    async def publish(self) -> None:
        """Logs a state transition and updates readiness."""
        state, message = self.state, self.message
        if (state, message) == self._published:
            return
        if self._published is None or state != self._published[0]:
            logger.info("state %s%s", worker_pb2.WorkerState.Name(state), f": {message}" if message else "")
        self._published = (state, message)
        if self.draining:
            await self._health.enter_graceful_shutdown()
        else:
            await self._health.set(WORKER_SERVICE, SERVING if state == worker_pb2.WORKER_STATE_READY
                                   else NOT_SERVING)
