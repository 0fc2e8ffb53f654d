"""The model's desired state and the operations that change it on every runner: Init, Sleep,
WakeUp, LoadWeights, PushWeights, LoadAdapter, UnloadAdapter, and bringing a restarted or newly
attached runner to that state.

An operation on every runner holds the gate exclusively: no batch executes meanwhile, so weights
never change under a request. Bringing one runner to the desired state holds it serialized: that
runner gets no work meanwhile, so the others keep serving. An operation goes to every reachable
runner at once through ``_on_all``, the one place its failures are handled; each runner's handle
sorts its own call's failure (``on_call_outcome``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import TypeVar

import grpc

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.errors import ServiceError, failed_precondition, not_found, unavailable
from serving_common.tensor_stream import ChunkChecker, PushReader
from worker_service.desired_state import DesiredState, RegisteredAdapter, WeightUpdate
from worker_service.lifecycle import Lifecycle
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import RunnerState
from worker_service.runners.push_relay import PushRelay
from worker_service.state_store import StateStore
from worker_service.weight_push import PushStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
INFO_TIMEOUT_S = 2.0


class ModelController:
    """Keeps the desired state and drives the runners to it. ``wakeup`` tells the dispatcher to look
    again."""

    def __init__(self, pool: RunnerPool, gate: ExecutionGate, lifecycle: Lifecycle, model: str, dtype: int,
                 wakeup: asyncio.Event, store: StateStore, pushes: PushStore,
                 acceleration: common_pb2.Acceleration | None = None,
                 parallel: common_pb2.Parallelism | None = None,
                 overrides: Sequence[common_pb2.ComponentOverride] = (),
                 fused: Sequence[common_pb2.FusedAdapter] = ()) -> None:
        self._pool = pool
        self._gate = gate
        self._pushes = pushes
        self._lifecycle = lifecycle
        self._wakeup = wakeup
        self._store = store
        # A saved state wins over --model: it is what the runners held when the worker stopped.
        self.desired = store.load() or (
            DesiredState.loading(model, dtype, acceleration, parallel, overrides, fused) if model else None)
        self._keep_pushes_in_effect()  # a push cut by a crash left a file that no update refers to
        self._applies: dict[RunnerHandle, asyncio.Task[None]] = {}

    def start(self) -> None:
        """Follows the runners; each one that appears gets the desired state, and one found holding
        something else (someone called it directly) gets it again."""
        self._pool.start(self.on_runner_change, self.check_runner)

    async def refresh(self) -> None:
        """Publishes the lifecycle state and wakes the dispatcher."""
        await self._lifecycle.publish()
        self._wakeup.set()

    # -- bringing each runner to the desired state --------------------------------------------

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
        await self.refresh()

    async def check_runner(self, runner: RunnerHandle) -> None:
        """The poller read ``runner``'s info: a ready runner that no longer holds the desired state
        (nothing the worker did changed it: an operation would hold the gate) gets it back. One that
        refused the desired state keeps its reason until the next Init."""
        if (self._gate.busy or not runner.ready or runner.info is None
                or self.desired is None or self.desired.held_by(runner.info)):
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
                instance, desired = runner.instance_id, self.desired
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
                    await self._apply_locked(runner, desired)
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

    async def _apply_locked(self, runner: RunnerHandle, desired: DesiredState,
                            timeout: float | None = None) -> common_pb2.RunnerInfo:
        """LoadModel, then each weight update and adapter (the same files, checked by digest), then
        Sleep; the handle hears that it began and how it ended (a runner that answered with an error
        refused). ``timeout``: the caller's deadline, for each call."""
        runner.apply_begun()
        try:
            loaded: runner_pb2.LoadModelResponse = await runner.call(runner.stub.LoadModel(
                runner_pb2.LoadModelRequest(source=desired.load_source, dtype=desired.dtype,  # type: ignore[arg-type]
                                            acceleration=desired.acceleration_message(),
                                            parallel=desired.parallel_message(),
                                            component_overrides=desired.overrides_message(),
                                            fused_adapters=desired.fused_message()),
                timeout=timeout))
            info = loaded.info
            if desired is self.desired and desired.pin(info.model):
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
                                                               expected_digest=adapter.digest)))
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

    # -- operations on every runner ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Holds the gate exclusively; the lifecycle state is published once the operation ends."""
        try:
            async with self._gate.exclusive():
                yield
        finally:
            await self.refresh()

    async def _on_all(self, work: Callable[[RunnerHandle], Awaitable[T]], changes_state: bool = True,
                      targets: list[RunnerHandle] | None = None) -> list[tuple[RunnerHandle, T]]:
        """Runs ``work`` on every reachable runner (or ``targets``) at once. A runner that turns out
        unreachable is left for re-apply (when another succeeded); any other failure is raised.

        An operation that ``changes_state`` changes the desired state: the runners it does not
        reach no longer hold it, and get it again when they may. A runner whose outcome is unknown
        (the call timed out or was cancelled, so the operation may still be running there) gets no
        work until the desired state, which the failed operation did not change, has been applied
        again. Nothing a caller was told failed takes effect later."""
        targets = self._pool.reachable() if targets is None else targets
        if not targets:
            raise unavailable(f"no runner can be reached ({self._pool.describe()})")
        if changes_state:
            for runner in self._pool.runners:
                if runner not in targets:
                    runner.missed()
        try:
            results = await asyncio.gather(*(work(r) for r in targets), return_exceptions=True)
        except BaseException:  # the caller went away (its deadline passed): every outcome is unknown
            self._outcomes_unknown(targets, changes_state)
            raise
        done: list[tuple[RunnerHandle, T]] = []
        failures: list[ServiceError] = []
        for runner, result in zip(targets, results, strict=True):
            if isinstance(result, ServiceError):
                failures.append(result)  # its handle sorted it already
            elif isinstance(result, BaseException):
                self._outcomes_unknown(targets, changes_state)
                raise result
            else:
                done.append((runner, result))
        real = [f for f in failures if f.code != grpc.StatusCode.UNAVAILABLE]
        if real or not done:
            await self._follow_runners(targets)
            raise (real or failures)[0]
        return done

    @staticmethod
    def _outcomes_unknown(runners: list[RunnerHandle], changes_state: bool) -> None:
        if changes_state:
            for runner in runners:
                runner.on_call_outcome(grpc.StatusCode.CANCELLED, changes_state=True)

    async def _follow_runners(self, runners: list[RunnerHandle]) -> None:
        """After a failed operation: the desired state follows what the runners really hold."""
        for runner in runners:
            await self._pool.refresh_info(runner, INFO_TIMEOUT_S)
        holding = next((r.info for r in runners if r.ready and r.info is not None), None)
        if holding is not None and self.desired is not None:
            self.desired.follow(holding, holding.model.sleep_level)
            self._changed()

    def _follow(self, info: common_pb2.RunnerInfo, level: int) -> None:
        """After a Sleep or WakeUp: the desired state takes what the runners report."""
        if self.desired is not None:
            self.desired.follow(info, level)
            self._changed()

    async def init(self, model: str, dtype: int, acceleration: common_pb2.Acceleration | None = None,
                   parallel: common_pb2.Parallelism | None = None, timeout: float | None = None,
                   on_dropped: Callable[[Collection[str]], None] | None = None,
                   overrides: Sequence[common_pb2.ComponentOverride] = (),
                   fused: Sequence[common_pb2.FusedAdapter] = ()) -> common_pb2.RunnerInfo:
        """Loads ``model`` (with ``acceleration`` and ``parallel``; None: plain, one device; its
        component ``overrides`` and ``fused`` adapters, kept in the desired state) on every
        runner after the requests in flight; forgets the weights loaded before. The adapters stay
        when ``model`` is the model loaded now (registered again on its fresh load); Init of another
        model drops them, and ``on_dropped`` gets their names before the dispatcher may start another
        batch: the caller ends the queued requests that name them, which can no longer run.

        When every runner refused the new model before unloading the old one (a bad path, say),
        the old model keeps serving and the call fails with the runner's reason."""
        logger.info("Init of model %s once the batches running now are done", model)
        async with self._exclusive():
            previous = self.desired
            desired = self.desired = DesiredState.loading(model, dtype, acceleration, parallel, overrides, fused)
            if previous is not None and previous.model == model:
                desired.adapters = list(previous.adapters)
            await self._lifecycle.begin_loading(model)
            try:
                done = await self._on_all(lambda r: self._apply_locked(r, desired, timeout=timeout))
            except ServiceError as failure:
                if not await self._still_serving(previous):
                    await self._lifecycle.load_failed(f"loading model {model} failed: {failure.message}")
                raise
            except BaseException:
                await self._lifecycle.load_failed(f"loading model {model} did not finish")
                raise
            finally:
                dropped = [a.name for a in previous.adapters if a.name not in self.adapter_names()] if previous else []
                if dropped and on_dropped is not None:
                    on_dropped(dropped)
            await self._lifecycle.loaded()
            self._changed()
            return done[0][1]

    async def _still_serving(self, previous: DesiredState | None) -> bool:
        """Whether every reachable runner refused the new model and still holds ``previous``; if so
        ``previous`` stays the desired state, and they hold it."""
        runners = self._pool.reachable()
        for runner in runners:
            await self._pool.refresh_info(runner, INFO_TIMEOUT_S)
        if previous is None or not runners or not all(
                r.state is RunnerState.REFUSED and r.info is not None and r.info.HasField("model")
                and previous.is_model(r.info.model) for r in runners):
            return False
        self.desired = previous
        for runner in runners:
            runner.applied()
        await self._lifecycle.loaded()
        logger.warning("Init of a new model failed; model %s still serves", previous.model)
        return True

    async def sleep(self, level: int, tags: list[str],
                    timeout: float | None = None) -> runner_pb2.RunnerServiceSleepResponse:
        async with self._exclusive():
            done = await self._on_all(lambda r: r.call(r.stub.Sleep(
                runner_pb2.RunnerServiceSleepRequest(level=level, tags=tags), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            reply: runner_pb2.RunnerServiceSleepResponse = done[0][1]
            reply.freed_bytes = sum(d[1].freed_bytes for d in done)
            reply.weight_bytes_released = sum(d[1].weight_bytes_released for d in done)
            self._follow(reply.info, level)
            return reply

    async def wake_up(self, tags: list[str], timeout: float | None = None) -> runner_pb2.RunnerServiceWakeUpResponse:
        async with self._exclusive():
            done = await self._on_all(lambda r: r.call(r.stub.WakeUp(
                runner_pb2.RunnerServiceWakeUpRequest(tags=tags), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            reply: runner_pb2.RunnerServiceWakeUpResponse = done[0][1]
            reply.weight_bytes_restored = sum(d[1].weight_bytes_restored for d in done)
            self._follow(reply.info, self.desired.sleep_level if self.desired else 0)
            return reply

    async def load_weights(self, path: str,
                           timeout: float | None = None) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        """Loads weights on every runner after the requests in flight and remembers them for re-apply."""
        async with self._exclusive():
            done = await self._on_all(lambda r: r.call(r.stub.LoadWeights(
                runner_pb2.RunnerServiceLoadWeightsRequest(path=path), timeout=timeout)))
            for runner, result in done:
                runner.weights_changed(result.weights_version)
            reply: runner_pb2.RunnerServiceLoadWeightsResponse = done[0][1]
            if self.desired is not None and reply.loaded_names:
                self.desired.add_update(WeightUpdate(path, reply.update.digest, names=tuple(reply.loaded_names)))
                self._changed()
            return reply

    def adapter_names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.desired.adapters) if self.desired is not None else frozenset()

    async def load_adapter(self, name: str, path: str, pin: bool,
                           timeout: float | None = None) -> common_pb2.AdapterInfo:
        """Registers an adapter on every runner, between batches, and remembers it for re-apply."""
        async with self._exclusive():
            desired = self._require_desired()
            done = await self._on_all(lambda r: r.call(r.stub.LoadAdapter(
                runner_pb2.RunnerServiceLoadAdapterRequest(name=name, path=path, pin=pin), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            adapter: common_pb2.AdapterInfo = done[0][1].adapter
            desired.with_adapter(RegisteredAdapter(name, path, pin, adapter.digest))
            self._changed()
            return adapter

    async def unload_adapter(self, name: str, timeout: float | None,
                             on_unloaded: Callable[[Collection[str]], None]) -> None:
        """Unregisters an adapter on every runner once the batches running now (which may use it)
        are done. ``on_unloaded`` runs before the dispatcher may start another batch: the caller
        ends the queued requests that name the adapter, which can no longer run."""
        logger.info("adapter %s: unloading once the batches running now are done", name)
        async with self._exclusive():
            desired = self._require_desired()
            if name not in self.adapter_names():
                raise not_found(f"adapter {name!r} is not registered")
            done = await self._on_all(lambda r: r.call(r.stub.UnloadAdapter(
                runner_pb2.RunnerServiceUnloadAdapterRequest(name=name), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            desired.without_adapter(name)
            self._changed()
            on_unloaded([name])

    async def _replay_push(self, runner: RunnerHandle,
                           update: WeightUpdate) -> runner_pb2.RunnerServicePushWeightsResponse:
        """Sends a kept push to a runner again; the runner checks its sha256 as it did the first time."""
        reply: runner_pb2.RunnerServicePushWeightsResponse = await runner.call(
            runner.push_serialized(self._pushes.replay(update.path)))
        if reply.update.digest != update.digest:
            raise failed_precondition(f"the replayed push {update.path} gave digest {reply.update.digest[:12]}, "
                                      f"not {update.digest[:12]}")
        return reply

    async def push_weights(self, requests: AsyncIterator[worker_pb2.PushWeightsRequest],
                           timeout: float | None = None) -> worker_pb2.PushWeightsResponse:
        """Relays a PushWeights stream to every reachable runner while it arrives, keeping it on disk;
        at the client's commit, commits it on all of them together, between batches: each runner
        checks the commit's sha256 against what it received (the worker does not hash it again).
        Anything else (a cut stream, a bad chunk, a wrong sha256) changes nothing; a push that
        sets no tensor changes nothing either, and is not kept."""
        self._require_desired()
        relays = [PushRelay(runner, timeout) for runner in self._pool.reachable()]
        if not relays:
            raise unavailable(f"no runner can be reached ({self._pool.describe()})")
        push = self._pushes.create()
        reader = PushReader(ChunkChecker(push, "--max-pushed-bytes"))
        kept = False
        try:
            async for request, _ in reader.chunks(requests):
                data = request.SerializeToString()  # the runner's request has the same wire form
                push.write(data)
                for relay in relays:
                    await relay.send(data)
            commit = runner_pb2.RunnerServicePushWeightsRequest(
                commit=common_pb2.PushWeightsCommit(sha256=reader.declared)).SerializeToString()
            push.write(commit)
            reply = await self._commit_push(relays, commit, str(push.path))
            kept = bool(reply.loaded_names)
        finally:
            for relay in relays:
                relay.abandon()
            self._pushes.finished(push, keep=kept)
        return worker_pb2.PushWeightsResponse(loaded_names=reply.loaded_names, weights_version=reply.weights_version,
                                              checksum=reply.checksum, bytes_received=reader.checker.received_bytes)

    async def _commit_push(self, relays: list[PushRelay], commit: bytes,
                           path: str) -> runner_pb2.RunnerServicePushWeightsResponse:
        """Commits the push on every runner it was relayed to; runners attached or back meanwhile
        get it from the push file, as a re-apply."""
        async with self._exclusive():
            by_runner = {relay.runner: relay for relay in relays}
            done = await self._on_all(lambda r: by_runner[r].commit(commit), targets=list(by_runner))
            for runner, result in done:
                runner.weights_changed(result.weights_version, result.checksum)
            reply = done[0][1]
            if reply.loaded_names:
                self._require_desired().add_update(WeightUpdate(path, reply.update.digest, pushed=True,
                                                                names=tuple(reply.loaded_names)))
                self._changed()
            return reply

    async def weights_checksum(self, timeout: float | None = None
                               ) -> runner_pb2.RunnerServiceGetWeightsChecksumResponse:
        """The checksum every reachable runner computes for its weights; they must agree."""
        done = await self._on_all(lambda r: r.call(r.stub.GetWeightsChecksum(
            runner_pb2.RunnerServiceGetWeightsChecksumRequest(), timeout=timeout), changes_state=False),
            changes_state=False)
        checksums = {result.checksum for _, result in done}
        if len(checksums) > 1:
            raise failed_precondition(f"the runners hold different weights ({', '.join(c[:12] for c in checksums)}); "
                                      "Init brings them back to one model")
        for runner, result in done:
            runner.checksum_computed(result.weights_version, result.checksum)
        reply: runner_pb2.RunnerServiceGetWeightsChecksumResponse = done[0][1]
        return reply

    def _require_desired(self) -> DesiredState:
        if self.desired is None:
            raise failed_precondition("no model is loaded; call Init")
        return self.desired

    def _changed(self) -> None:
        """The desired state changed: the store keeps it, and push files no update refers to go."""
        self._store.save(self.desired)
        self._keep_pushes_in_effect()

    def _keep_pushes_in_effect(self) -> None:
        updates = self.desired.weight_updates if self.desired is not None else []
        self._pushes.keep_only(u.path for u in updates if u.pushed)
