"""The worker's lifecycle state, derived from a few facts, published to GetStatus and health.

STARTING: no runner reachable yet, or no model. LOADING: Init in progress. READY. SLEEPING: some
component asleep. FAILED: the last Init failed. DRAINING: shutting down. Readiness (health of
``diffusion.v1.WorkerService``) is SERVING only in READY; ``""`` stays SERVING while alive.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health

from clients.rpc import NOT_SERVING, SERVING
from diffusion.v1 import common_pb2, worker_pb2

from .errors import RpcFailure

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


class Lifecycle:
    """Facts about the runner and model; ``state`` and readiness follow from them."""

    def __init__(self, health_servicer: health.aio.HealthServicer, runner_target: str) -> None:
        self._health = health_servicer
        self.runner_target = runner_target  # the runners, for messages
        self.runner_connected = False
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
    def state(self) -> int:
        if self.draining:
            return worker_pb2.WORKER_STATE_DRAINING
        if self.loading is not None:
            return worker_pb2.WORKER_STATE_LOADING
        if not self.runner_connected:
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
            if not self.runner_connected:
                return f"waiting for a ready runner ({self.runner_target})"
            return "no model loaded; call Init"
        if state == worker_pb2.WORKER_STATE_SLEEPING:
            return (f"model is asleep (level {self.model.sleep_level if self.model else 0}): "
                    f"{', '.join(self.sleeping_components)}; call WakeUp")
        return ""

    def generation_blocker(self, auto_wake: bool) -> RpcFailure | None:
        """Why a request cannot run now (draining aside), or None; a sleeping model is fine with auto-wake."""
        state = self.state
        if state == worker_pb2.WORKER_STATE_READY:
            return None
        if state == worker_pb2.WORKER_STATE_SLEEPING:
            return None if auto_wake else RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                                     "model is asleep; call WakeUp")
        if not self.runner_connected and state != worker_pb2.WORKER_STATE_LOADING:
            return RpcFailure(grpc.StatusCode.UNAVAILABLE, f"no runner is ready ({self.runner_target})")
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"worker is not ready: {self.message}")

    async def update(self, **facts: object) -> None:
        """Sets any of the facts above, then logs the transition and updates readiness."""
        for name, value in facts.items():
            if not hasattr(self, name) or name.startswith("_"):
                raise AttributeError(name)
            setattr(self, name, value)
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
