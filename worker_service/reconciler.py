"""Bringing each runner to the model's desired state: one that appears (started, restarted,
attached) gets it, one found holding something else gets it again, one leaving stops getting it.

Bringing one runner to the desired state holds it serialized: that runner gets no work meanwhile, so
the others keep serving. With no other runner ready, the worker's state is LOADING meanwhile and
FAILED on a failure. The desired state itself is the controller's (``desired``); this module only
reads it, and saves it when a Hugging Face id resolved to a commit.

Every apply loads the model again, so it tells ``on_outputs_change`` (the result cache drops every
entry) before it begins: the same desired state need not load the same weights (a model directory
whose files changed loads under the same identity), nor did a runner whose state changed behind
the worker's back make the same images meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from diffusion.v1 import common_pb2, runner_pb2
from serving_common.errors import ServiceError, failed_precondition
from worker_service.desired_state import DesiredState, WeightUpdate
from worker_service.lifecycle import Lifecycle
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import RunnerState
from worker_service.state_store import StateStore
from worker_service.weight_push import PushStore

logger = logging.getLogger(__name__)


class Reconciler:
    """Drives each runner of ``pool`` to ``desired()``; ``refresh`` publishes the lifecycle state and
    wakes the dispatcher."""

    def __init__(self, pool: RunnerPool, gate: ExecutionGate, lifecycle: Lifecycle,
                 desired: Callable[[], DesiredState | None], store: StateStore, pushes: PushStore,
                 refresh: Callable[[], Awaitable[None]], on_outputs_change: Callable[[], None] = lambda: None) -> None:
        self._pool = pool
        self._gate = gate
        self._lifecycle = lifecycle
        self._desired = desired
        self._store = store
        self._pushes = pushes
        self._refresh = refresh
        self._on_outputs_change = on_outputs_change
        self._applies: dict[RunnerHandle, asyncio.Task[None]] = {}

    async def on_runner_change(self, runner: RunnerHandle) -> None:
        """A runner that lacks the desired state gets it; one leaving the pool stops getting it."""
        task = self._applies.get(runner)
        if runner.state is RunnerState.DETACHING:
            if task is not None:
                self._applies.pop(runner, None)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        elif (runner.state is RunnerState.CONNECTED and runner in self._pool.runners
              and (task is None or task.done())):
            self._applies[runner] = asyncio.create_task(self._apply_to(runner), name=f"apply {runner.target}")
        await self._refresh()

    async def check_runner(self, runner: RunnerHandle) -> None:
        """The poller read ``runner``'s info: a ready runner that no longer holds the desired state
        (nothing the worker did changed it: an operation would hold the gate) gets it back. One that
        refused the desired state keeps its reason until the next Init."""
        desired = self._desired()
        if (self._gate.busy or not runner.ready or runner.info is None
                or desired is None or desired.held_by(runner.info)):
            return
        logger.warning("runner %s holds state the worker did not ask for (model %s, asleep %s); re-applying",
                       runner.target, runner.info.model.source or "none",
                       [c.name for c in runner.info.model.components if c.asleep])
        runner.missed()

    async def _apply_to(self, runner: RunnerHandle) -> None:
        """Brings ``runner`` to the desired state, until its instance holds it, or refuses it. With no
        other runner ready, the worker's state is LOADING meanwhile and FAILED on a failure."""
        while runner.state is RunnerState.CONNECTED:
            async with self._gate.serialized():
                if runner.state is not RunnerState.CONNECTED:
                    break  # gone again, or an operation meanwhile brought it to the desired state
                instance, desired = runner.instance_id, self._desired()
                if desired is None:
                    runner.applied()
                    await self._lifecycle.loaded()
                    break
                if runner.info is not None and desired.held_by(runner.info):
                    logger.info("runner %s ready (instance %s): it already held the desired state", runner.target,
                                instance)
                    runner.applied()
                    await self._lifecycle.loaded()
                    break
                logger.info("runner %s (instance %s): applying model %s%s", runner.target, instance,
                            desired.model, f" and {len(desired.weight_updates)} weight update(s)"
                            if desired.weight_updates else "")
                alone = not any(r.ready for r in self._pool.runners if r is not runner)
                if alone:
                    await self._lifecycle.begin_loading(desired.model)
                try:
                    await self.apply(runner, desired)
                except ServiceError as failure:
                    logger.error("applying model %s to runner %s failed: %s", desired.model, runner.target,
                                 failure.message)
                    if alone:
                        await self._lifecycle.load_failed(f"loading model {desired.model} failed: {failure.message}")
                    break  # unreachable: applied again once it answers; refused: at the next Init or instance
                except BaseException:
                    if alone:
                        await self._lifecycle.load_failed(f"loading model {desired.model} did not finish")
                    raise
                await self._lifecycle.loaded()
                logger.info("runner %s ready (instance %s)", runner.target, runner.instance_id)

    async def apply(self, runner: RunnerHandle, desired: DesiredState,
                            timeout: float | None = None) -> common_pb2.RunnerInfo:
        """LoadModel, then each weight update and adapter (the same files, checked by digest), then
        Sleep; the handle hears that it began and how it ended (a runner that answered with an error
        refused). ``timeout``: the caller's deadline, for each call. ``on_outputs_change`` hears of it
        first, once the runner gets no work."""
        runner.apply_begun()
        self._on_outputs_change()
        try:
            loaded: runner_pb2.LoadModelResponse = await runner.call(runner.stub.LoadModel(
                runner_pb2.LoadModelRequest(source=desired.load_source, dtype=desired.dtype,  # type: ignore[arg-type]
                                            acceleration=desired.acceleration_message(),
                                            parallel=desired.parallel_message(),
                                            component_overrides=desired.overrides_message(),
                                            fused_adapters=desired.fused_message()),
                timeout=timeout))
            info = loaded.info
            if desired is self._desired() and desired.pin(info.model):
                logger.info("model %s resolved to commit %s: later loads ask for that snapshot", desired.model,
                            desired.revision)
                self._store.save(desired)
            for update in desired.weight_updates:
                if update.pushed:
                    reply = await self._replay_push(runner, update)
                else:
                    reply = await runner.call(runner.stub.LoadWeights(
                        runner_pb2.RunnerServiceLoadWeightsRequest(path=update.path, expected_digest=update.digest)))
                info.weights_version = reply.weights_version
            for adapter in desired.adapters:
                registered: runner_pb2.RunnerServiceLoadAdapterResponse = await runner.call(runner.stub.LoadAdapter(
                    runner_pb2.RunnerServiceLoadAdapterRequest(name=adapter.name, path=adapter.path, pin=adapter.pin,
                                                               expected_digest=adapter.digest,
                                                               kind=adapter.kind)))  # type: ignore[arg-type]
                info = registered.info
            if desired.sleep_level:
                slept: runner_pb2.RunnerServiceSleepResponse = await runner.call(runner.stub.Sleep(
                    runner_pb2.RunnerServiceSleepRequest(level=desired.sleep_level, tags=desired.sleep_tags)))
                info = slept.info
        except ServiceError as failure:
            if runner.state is RunnerState.APPLYING:  # it answered: it cannot take the desired state
                runner.apply_refused(failure.message)
            raise
        runner.applied(info)  # with the model (the Watch's GetInfo came before it)
        return info

    async def _replay_push(self, runner: RunnerHandle,
                           update: WeightUpdate) -> runner_pb2.RunnerServicePushWeightsResponse:
        """Sends a kept push to a runner again; the runner checks its sha256 as it did the first time."""
        reply: runner_pb2.RunnerServicePushWeightsResponse = await runner.call(
            runner.push_serialized(self._pushes.replay(update.path)))
        if reply.update.digest != update.digest:
            raise failed_precondition(f"the replayed push {update.path} gave digest {reply.update.digest[:12]}, "
                                      f"not {update.digest[:12]}")
        return reply

