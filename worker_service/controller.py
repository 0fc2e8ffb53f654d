"""The model's desired state and the lifecycle operations that change it on every runner: Init,
Sleep, WakeUp, LoadWeights, LoadAdapter, UnloadAdapter, and bringing a restarted or newly attached runner to that state.

The pool's ``lock`` serializes the operations and the re-applies. An operation also pauses the
dispatcher and waits until no batch is executing (on any runner), so weights never change under
a request; a re-apply touches one runner that gets no work meanwhile, so the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, not_found, unavailable
from serving_common.tensor_stream import ChunkChecker
from worker_service.desired_state import DesiredState, RegisteredAdapter, WeightUpdate
from worker_service.lifecycle import Lifecycle
from worker_service.runners import RunnerClient, RunnerPool
from worker_service.state_store import StateStore
from worker_service.weight_push import PushStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
# A runner call that ended so may still be running on the runner: its outcome is unknown.
OUTCOME_UNKNOWN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
INFO_TIMEOUT_S = 2.0


async def _call(runner: RunnerClient, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise ServiceError.from_rpc_error(error, runner.target) from None


class ModelController:
    """Drives the runners' model. ``wakeup`` tells the dispatcher to look again."""

    def __init__(self, pool: RunnerPool, lifecycle: Lifecycle, model: str, dtype: int,
                 wakeup: asyncio.Event, store: StateStore, pushes: PushStore) -> None:
        self._pool = pool
        self._pushes = pushes
        self._lifecycle = lifecycle
        self._wakeup = wakeup
        self._store = store
        # A saved state wins over --model: it is what the runners held when the worker stopped.
        self.desired = store.load() or (DesiredState(model, dtype) if model else None)
        self._keep_pushes_in_effect()  # a push cut by a crash left a file that no update refers to
        self.paused = 0  # operations waiting for or holding exclusive use of the runners
        self._executing = 0  # batches running now, on all runners
        self._executions_done = asyncio.Event()
        self._executions_done.set()

    def start(self) -> None:
        """Follows the runners; each one that appears gets the desired state, and one found holding
        something else (someone called it directly) gets it again."""
        self._pool.start(self.on_runner_change, self.check_runner)

    async def refresh(self) -> None:
        """Publishes runner facts to the lifecycle and wakes the dispatcher."""
        await self._lifecycle.set_runners(bool(self._pool.ready()), self._pool.describe())
        self._wakeup.set()

    async def on_runner_change(self, runner: RunnerClient) -> None:
        """A runner instance that lacks the desired state gets it."""
        if (runner.connected and runner.instance_id != runner.applied_instance and runner in self._pool.runners
                and (runner.apply_task is None or runner.apply_task.done())):
            runner.apply_task = asyncio.create_task(self._apply_to(runner), name=f"apply {runner.target}")
        await self.refresh()

    async def check_runner(self, runner: RunnerClient) -> None:
        """The poller read ``runner``'s info: a ready runner that no longer holds the desired state
        (nothing the worker did changed it: an operation would hold the lock) gets it back. One that
        refused the desired state keeps its reason until the next Init."""
        if (self._pool.lock.locked() or not runner.ready or runner.apply_error or runner.info is None
                or self.desired is None or self.desired.held_by(runner.info)):
            return
        logger.warning("runner %s holds state the worker did not ask for (model %s, asleep %s); re-applying",
                       runner.target, runner.info.model.source or "none",
                       [c.name for c in runner.info.model.components if c.asleep])
        self._reapply_later([runner])

    async def _apply_to(self, runner: RunnerClient) -> None:
        """Brings ``runner`` to the desired state, until its instance holds it (or it fails)."""
        while runner.connected and runner.instance_id != runner.applied_instance and runner in self._pool.runners:
            instance = runner.instance_id
            async with self._pool.lock:
                if not runner.connected or runner.instance_id == runner.applied_instance:
                    break  # gone again, or an Init meanwhile brought it to the desired state
                if self.desired is None:
                    runner.applied_instance = instance
                    await self._lifecycle.loaded(None, "")
                    break
                alone = not any(r.ready for r in self._pool.runners if r is not runner)
                if runner.info is not None and self.desired.held_by(runner.info):
                    logger.info("runner %s ready (instance %s): it already held the desired state", runner.target,
                                instance)
                    runner.applied_instance = instance
                    if alone or self._lifecycle.model is None:
                        await self._lifecycle.loaded(runner.info.model, runner.info.weights_version)
                    break
                logger.info("runner %s (instance %s): applying model %s%s", runner.target, instance,
                            self.desired.model, f" and {len(self.desired.weight_updates)} weight update(s)"
                            if self.desired.weight_updates else "")
                try:
                    await self._apply_locked(runner, self.desired, publish=alone, keep_failed=alone)
                except ServiceError as failure:
                    runner.apply_error = failure.message
                    logger.error("applying model %s to runner %s failed: %s", self.desired.model,
                                 runner.target, failure.message)
                    break  # UNAVAILABLE: tried again when the Watch sees it back; else until the next Init
                runner.apply_error = ""
                logger.info("runner %s ready (instance %s)", runner.target, runner.applied_instance)
            await self.refresh()
        await self.refresh()

    async def _apply_locked(self, runner: RunnerClient, desired: DesiredState, publish: bool = True,
                            keep_failed: bool = True, timeout: float | None = None) -> common_pb2.RunnerInfo:
        """LoadModel, then each weight update and adapter (the same files, checked by digest), then Sleep. With
        ``publish``, the worker's state is LOADING meanwhile and FAILED on error (the runner is the
        one that matters). With ``keep_failed``, a runner that refused the state (not an unreachable
        one) still counts as holding it: the worker's FAILED state then blocks generation until the
        next Init. ``timeout``: the caller's deadline, for each call."""
        if publish:
            await self._lifecycle.begin_loading(desired.model)
        try:
            loaded: runner_pb2.LoadModelResponse = await _call(runner, runner.stub.LoadModel(
                runner_pb2.LoadModelRequest(source=desired.model, dtype=desired.dtype),  # type: ignore[arg-type]
                timeout=timeout))
            info = loaded.info
            for update in desired.weight_updates:
                if update.pushed:
                    reply = await self._replay_push(runner, update)
                else:
                    reply = await _call(runner, runner.stub.LoadWeights(
                        runner_pb2.RunnerServiceLoadWeightsRequest(path=update.path, expected_digest=update.digest)))
                info.weights_version = reply.weights_version
            for adapter in desired.adapters:
                registered: runner_pb2.RunnerServiceLoadAdapterResponse = await _call(runner, runner.stub.LoadAdapter(
                    runner_pb2.RunnerServiceLoadAdapterRequest(name=adapter.name, path=adapter.path, pin=adapter.pin,
                                                               expected_digest=adapter.digest)))
                info = registered.info
            if desired.sleep_level:
                slept: runner_pb2.RunnerServiceSleepResponse = await _call(runner, runner.stub.Sleep(
                    runner_pb2.RunnerServiceSleepRequest(level=desired.sleep_level, tags=desired.sleep_tags)))
                info = slept.info
        except ServiceError as failure:
            refused = failure.code != grpc.StatusCode.UNAVAILABLE
            runner.applied_instance = runner.instance_id if keep_failed and refused else None
            if publish:
                await self._lifecycle.load_failed(f"loading model {desired.model} failed: {failure.message}")
            raise
        runner.applied_instance = info.instance_id
        runner.info = info  # with the model (the Watch's GetInfo came before it)
        if publish or self._lifecycle.model is None:
            await self._lifecycle.loaded(info.model, info.weights_version)
        return info

    # -- exclusive operations on every runner ----------------------------------------------

    def execution_started(self) -> None:
        self._executing += 1
        self._executions_done.clear()

    def execution_finished(self) -> None:
        self._executing -= 1
        if self._executing == 0:
            self._executions_done.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds the pool's lock with the dispatcher paused and every running batch finished."""
        self.paused += 1
        try:
            async with self._pool.lock:
                await self._executions_done.wait()
                yield
        finally:
            self.paused -= 1
            self._wakeup.set()

    async def _on_all(self, work: Callable[[RunnerClient], Awaitable[T]]) -> list[tuple[RunnerClient, T]]:
        """Runs ``work`` on every reachable runner at once. A runner that turns out unreachable is
        left for re-apply (when another succeeded); any other failure is raised.

        A runner whose outcome is unknown (the call timed out or was cancelled, so the operation
        may still be running there) is marked for re-apply: it gets no work until the desired
        state, which the failed operation did not change, has been applied again. Nothing a
        caller was told failed takes effect later."""
        targets = self._pool.reachable()
        if not targets:
            raise unavailable(f"no runner can be reached ({self._pool.describe()})")
        for runner in self._pool.runners:
            if runner not in targets:
                runner.applied_instance = None  # it gets the new desired state when it is back
        try:
            results = await asyncio.gather(*(work(r) for r in targets), return_exceptions=True)
        except BaseException:  # the caller went away (its deadline passed): every outcome is unknown
            self._reapply_later(targets)
            raise
        done: list[tuple[RunnerClient, T]] = []
        failures: list[ServiceError] = []
        for runner, result in zip(targets, results, strict=True):
            if isinstance(result, ServiceError):
                failures.append(result)
                if result.code == grpc.StatusCode.UNAVAILABLE:
                    runner.applied_instance = None  # re-applied when it is back
                elif result.code in OUTCOME_UNKNOWN:
                    self._reapply_later([runner])
            elif isinstance(result, BaseException):
                self._reapply_later(targets)
                raise result
            else:
                done.append((runner, result))
        real = [f for f in failures if f.code != grpc.StatusCode.UNAVAILABLE]
        if real or not done:
            await self._follow_runners(targets)
            raise (real or failures)[0]
        return done

    def _reapply_later(self, runners: list[RunnerClient]) -> None:
        """Marks ``runners`` as not holding the desired state; each is brought back to it once the
        running operation has released the runners (its LoadModel waits for whatever still runs there)."""
        for runner in runners:
            logger.warning("runner %s: the outcome of an operation is unknown; re-applying the desired state",
                           runner.target)
            runner.applied_instance = None
            asyncio.create_task(self.on_runner_change(runner), name=f"re-apply {runner.target}")

    async def _follow_runners(self, runners: list[RunnerClient]) -> None:
        """After a failed operation: the worker's state follows what the runners really hold."""
        for runner in runners:
            await self._pool.refresh_info(runner, INFO_TIMEOUT_S)
        holding = [r.info for r in runners if r.ready and r.info is not None]
        if holding:
            info = holding[0]
            await self._lifecycle.set_model(info.model if info.HasField("model") else None)
            await self._lifecycle.set_weights_version(info.weights_version)
            if self.desired is not None:
                self.desired.sleep_tags = self._lifecycle.sleeping_components
                self.desired.sleep_level = self._lifecycle.sleep_level
                self.desired.keep_updates_in(info)
            self._changed()

    async def init(self, model: str, dtype: int, timeout: float | None = None) -> common_pb2.RunnerInfo:
        """Loads ``model`` on every runner after the requests in flight; forgets the weights loaded before.

        When every runner refused the new model before unloading the old one (a bad path, say),
        the old model keeps serving and the call fails with the runner's reason."""
        async with self.exclusive():
            previous = self.desired
            desired = self.desired = DesiredState(model, dtype)
            await self._lifecycle.begin_loading(model)
            try:
                done = await self._on_all(lambda r: self._apply_locked(r, desired, publish=False, timeout=timeout))
            except ServiceError as failure:
                if not await self._still_serving(previous):
                    await self._lifecycle.load_failed(f"loading model {model} failed: {failure.message}")
                raise
            except BaseException:
                await self._lifecycle.load_failed(f"loading model {model} did not finish")
                raise
            finally:
                await self.refresh()
            info = done[0][1]
            await self._lifecycle.loaded(info.model, info.weights_version)
            await self.refresh()
            self._changed()
            return info

    async def _still_serving(self, previous: DesiredState | None) -> bool:
        """Whether every reachable runner still holds ``previous`` after a failed Init; if so it stays
        the desired state."""
        runners = self._pool.reachable()
        for runner in runners:
            await self._pool.refresh_info(runner, INFO_TIMEOUT_S)
        infos = [r.info for r in runners]
        if previous is None or not runners or not all(
                info is not None and info.HasField("model") and info.model.source == previous.model
                and info.instance_id == r.applied_instance for r, info in zip(runners, infos, strict=True)):
            return False
        self.desired = previous
        kept = infos[0]
        assert kept is not None
        await self._lifecycle.loaded(kept.model, kept.weights_version)
        logger.warning("Init of a new model failed; model %s still serves", previous.model)
        return True

    async def sleep(self, level: int, tags: list[str],
                    timeout: float | None = None) -> runner_pb2.RunnerServiceSleepResponse:
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.Sleep(
                runner_pb2.RunnerServiceSleepRequest(level=level, tags=tags), timeout=timeout)))
            for runner, result in done:
                runner.info = result.info
            reply: runner_pb2.RunnerServiceSleepResponse = done[0][1]
            reply.freed_bytes = sum(d[1].freed_bytes for d in done)
            reply.weight_bytes_released = sum(d[1].weight_bytes_released for d in done)
            await self._record_sleep(reply.info, level)
            return reply

    async def wake_up(self, tags: list[str], timeout: float | None = None) -> runner_pb2.RunnerServiceWakeUpResponse:
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.WakeUp(
                runner_pb2.RunnerServiceWakeUpRequest(tags=tags), timeout=timeout)))
            for runner, result in done:
                runner.info = result.info
            reply: runner_pb2.RunnerServiceWakeUpResponse = done[0][1]
            reply.weight_bytes_restored = sum(d[1].weight_bytes_restored for d in done)
            await self._record_sleep(reply.info, self.desired.sleep_level if self.desired else 0)
            return reply

    async def _record_sleep(self, info: common_pb2.RunnerInfo, level: int) -> None:
        await self._lifecycle.set_model(info.model if info.HasField("model") else None)
        await self._lifecycle.set_weights_version(info.weights_version)
        asleep = self._lifecycle.sleeping_components
        if self.desired is not None:
            self.desired.sleep_level = level if asleep else 0
            self.desired.sleep_tags = asleep
            self.desired.keep_updates_in(info)
            self._changed()

    async def load_weights(self, path: str,
                           timeout: float | None = None) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        """Loads weights on every runner after the requests in flight and remembers them for re-apply."""
        async with self.exclusive():
            done = await self._on_all(lambda r: _call(r, r.stub.LoadWeights(
                runner_pb2.RunnerServiceLoadWeightsRequest(path=path), timeout=timeout)))
            for runner, result in done:
                if runner.info is not None:
                    runner.info.weights_version = result.weights_version
            reply: runner_pb2.RunnerServiceLoadWeightsResponse = done[0][1]
            if self.desired is not None and reply.loaded_names:
                self.desired.add_update(WeightUpdate(path, reply.update.digest, names=tuple(reply.loaded_names)))
                self._changed()
            await self._lifecycle.set_weights_version(reply.weights_version)
            return reply

    def adapter_names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.desired.adapters) if self.desired is not None else frozenset()

    async def load_adapter(self, name: str, path: str, pin: bool,
                           timeout: float | None = None) -> common_pb2.AdapterInfo:
        """Registers an adapter on every runner, between batches, and remembers it for re-apply."""
        async with self.exclusive():
            desired = self._require_desired()
            done = await self._on_all(lambda r: _call(r, r.stub.LoadAdapter(
                runner_pb2.RunnerServiceLoadAdapterRequest(name=name, path=path, pin=pin), timeout=timeout)))
            for runner, result in done:
                runner.info = result.info
            adapter: common_pb2.AdapterInfo = done[0][1].adapter
            desired.with_adapter(RegisteredAdapter(name, path, pin, adapter.digest))
            self._changed()
            return adapter

    async def unload_adapter(self, name: str, timeout: float | None, on_unloaded: Callable[[], None]) -> None:
        """Unregisters an adapter on every runner once the batches running now (which may use it)
        are done. ``on_unloaded`` runs before the dispatcher may start another batch: the caller
        ends the queued requests that name the adapter, which can no longer run."""
        logger.info("adapter %s: unloading once the batches running now are done", name)
        async with self.exclusive():
            desired = self._require_desired()
            if name not in self.adapter_names():
                raise not_found(f"adapter {name!r} is not registered")
            done = await self._on_all(lambda r: _call(r, r.stub.UnloadAdapter(
                runner_pb2.RunnerServiceUnloadAdapterRequest(name=name), timeout=timeout)))
            for runner, result in done:
                runner.info = result.info
            desired.without_adapter(name)
            self._changed()
            on_unloaded()

    async def _replay_push(self, runner: RunnerClient,
                           update: WeightUpdate) -> runner_pb2.RunnerServicePushWeightsResponse:
        """Sends a kept push to a runner again; the runner checks its sha256 as it did the first time."""
        reply: runner_pb2.RunnerServicePushWeightsResponse = await _call(
            runner, runner.push_serialized(self._pushes.replay(update.path)))
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
        relays = [_Relay(runner, timeout) for runner in self._pool.reachable()]
        if not relays:
            raise unavailable(f"no runner can be reached ({self._pool.describe()})")
        push = self._pushes.create()
        checker = ChunkChecker(push, "--max-pushed-bytes")
        kept = False
        try:
            declared = None
            async for request in requests:
                if declared is not None:
                    raise invalid_argument({"commit": "must be the last message"})
                if request.HasField("commit"):
                    declared = request.commit.sha256
                    continue
                checker.add(request.chunk)
                data = request.SerializeToString()  # the runner's request has the same wire form
                push.write(data)
                for relay in relays:
                    await relay.send(data)
            if declared is None:
                raise failed_precondition("the stream ended without its commit; nothing applied")
            checker.finish()
            commit = runner_pb2.RunnerServicePushWeightsRequest(
                commit=common_pb2.PushWeightsCommit(sha256=declared)).SerializeToString()
            push.write(commit)
            reply = await self._commit_push(relays, commit, str(push.path))
            kept = bool(reply.loaded_names)
        finally:
            for relay in relays:
                relay.abandon()
            self._pushes.finished(push, keep=kept)
        return worker_pb2.PushWeightsResponse(loaded_names=reply.loaded_names, weights_version=reply.weights_version,
                                              checksum=reply.checksum, bytes_received=checker.received_bytes)

    async def _commit_push(self, relays: list[_Relay], commit: bytes,
                           path: str) -> runner_pb2.RunnerServicePushWeightsResponse:
        async with self.exclusive():
            results = await asyncio.gather(*(relay.commit(commit) for relay in relays), return_exceptions=True)
            done: list[tuple[RunnerClient, runner_pb2.RunnerServicePushWeightsResponse]] = []
            failures: list[ServiceError] = []
            for relay, result in zip(relays, results, strict=True):
                if isinstance(result, ServiceError):
                    failures.append(result)
                    if result.code == grpc.StatusCode.UNAVAILABLE:
                        relay.runner.applied_instance = None  # it gets the update when it is back
                    elif result.code in OUTCOME_UNKNOWN:
                        self._reapply_later([relay.runner])
                elif isinstance(result, BaseException):
                    self._reapply_later([r.runner for r in relays])
                    raise result
                else:
                    done.append((relay.runner, result))
            real = [f for f in failures if f.code != grpc.StatusCode.UNAVAILABLE]
            if real or not done:
                await self._follow_runners([r.runner for r in relays])
                raise (real or failures)[0]
            late = [r for r in self._pool.runners if all(r is not relay.runner for relay in relays)]
            self._reapply_later(late)  # attached during the push: they get it from the push file
            for runner, result in done:
                if runner.info is not None:
                    runner.info.weights_version = result.weights_version
                    runner.info.weights_checksum = result.checksum
            reply = done[0][1]
            if reply.loaded_names:
                self._require_desired().add_update(WeightUpdate(path, reply.update.digest, pushed=True,
                                                                names=tuple(reply.loaded_names)))
                self._changed()
            await self._lifecycle.set_weights_version(reply.weights_version)
            return reply

    async def weights_checksum(self, timeout: float | None = None
                               ) -> runner_pb2.RunnerServiceGetWeightsChecksumResponse:
        """The checksum every reachable runner computes for its weights; they must agree."""
        done = await self._on_all(lambda r: _call(r, r.stub.GetWeightsChecksum(
            runner_pb2.RunnerServiceGetWeightsChecksumRequest(), timeout=timeout)))
        checksums = {result.checksum for _, result in done}
        if len(checksums) > 1:
            raise failed_precondition(f"the runners hold different weights ({', '.join(c[:12] for c in checksums)}); "
                                      "Init brings them back to one model")
        for runner, result in done:
            if runner.info is not None and runner.info.weights_version == result.weights_version:
                runner.info.weights_checksum = result.checksum
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


class _Relay:
    """One runner's PushWeights call, fed chunk by chunk while the client's stream arrives."""

    def __init__(self, runner: RunnerClient, timeout: float | None) -> None:
        self.runner = runner
        # A few chunks in flight per runner: the client's stream moves at the pace of the slowest.
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=8)
        self._call = runner.push_serialized(self._messages(), timeout=timeout)
        self._result = asyncio.ensure_future(_call(runner, self._call))

    async def _messages(self) -> AsyncIterator[bytes]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def send(self, message: bytes | None) -> None:
        """Queues a serialized message (None ends the stream), unless this runner's call has ended:
        it is then left for re-apply, and the others go on."""
        if not self._queue.full() and not self._result.done():
            self._queue.put_nowait(message)
            return
        while not self._result.done():
            try:
                await asyncio.wait_for(self._queue.put(message), timeout=1.0)
                return
            except TimeoutError:
                continue

    async def commit(self, commit: bytes) -> runner_pb2.RunnerServicePushWeightsResponse:
        await self.send(commit)
        await self.send(None)
        reply: runner_pb2.RunnerServicePushWeightsResponse = await self._result
        return reply

    def abandon(self) -> None:
        """Ends the call without a commit if it is still open: the runner applies nothing. A call
        that already ended (the runner refused, or its deadline passed) still has gRPC's task
        reading ``_messages``: the end of the stream lets it finish, rather than stay pending
        until it is garbage ("Task was destroyed but it is pending")."""
        if not self._result.done():
            self._call.cancel()
        elif not self._queue.full():
            self._queue.put_nowait(None)
        self._result.add_done_callback(lambda task: task.cancelled() or task.exception())
