"""The worker's lifecycle state, derived from a few facts, published to GetStatus and health.

STARTING: no runner reachable yet, or no model. LOADING: Init in progress. READY. SLEEPING: some
component asleep. FAILED: the last Init failed. DRAINING: shutting down. Readiness (health of
``diffusion.v1.WorkerService``) is SERVING only in READY; ``""`` stays SERVING while alive.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.errors import ServiceError, failed_precondition, unavailable
from serving_common.protocol import WORKER_SERVICE
from serving_common.server import NOT_SERVING, SERVING

logger = logging.getLogger(__name__)


class Lifecycle:
    """Facts about the runners and the model; ``state`` and readiness follow from them.

    The facts change only through the setters below, each of which publishes the new state.
    """

    def __init__(self, health_servicer: health.aio.HealthServicer, runner_targets: str) -> None:
        self._health = health_servicer
        self.runner_targets = runner_targets  # the runners, for messages
        self.runner_ready = False
        self.loading: str | None = None
        self.failure = ""
        self.model: common_pb2.ModelInfo | None = None
        self.weights_version = ""
        self.draining = False
        self._published: tuple[int, str] | None = None

    @property
    def sleeping_components(self) -> list[str]:
        return [c.name for c in self.model.components if c.asleep] if self.model else []

    @property
    def sleep_level(self) -> int:
        return self.model.sleep_level if self.model is not None and self.sleeping_components else 0

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

    async def set_runners(self, any_ready: bool, targets: str) -> None:
        self.runner_ready, self.runner_targets = any_ready, targets
        await self.publish()

    async def begin_loading(self, model: str) -> None:
        self.loading = model
        await self.publish()

    async def loaded(self, model: common_pb2.ModelInfo | None, weights_version: str) -> None:
        """A model (None: no model) now serves, with ``weights_version``; any failure is cleared."""
        self.loading, self.failure = None, ""
        self.model, self.weights_version = model, weights_version
        await self.publish()

    async def load_failed(self, failure: str) -> None:
        self.loading, self.failure = None, failure
        self.model, self.weights_version = None, ""
        await self.publish()

    async def set_model(self, model: common_pb2.ModelInfo | None) -> None:
        """The model as a runner reports it after a sleep or wake-up (which components are asleep)."""
        self.model = model
        await self.publish()

    async def set_weights_version(self, weights_version: str) -> None:
        self.weights_version = weights_version
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
