"""The model's desired state, its one owner, and the operations that change it on every runner:
Init, Sleep, WakeUp, LoadWeights, PushWeights, LoadAdapter, UnloadAdapter.

Each operation goes to every runner through ``FanOut`` (``fan_out.py``: the gate held exclusively,
the one place failures are handled); bringing a restarted or newly attached runner to the desired
state is the ``Reconciler``'s (``reconciler.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.errors import ServiceError, failed_precondition, not_found, unavailable
from serving_common.tensor_stream import ChunkChecker, PushReader
from worker_service.desired_state import DesiredState, RegisteredAdapter, WeightUpdate
from worker_service.fan_out import FanOut
from worker_service.lifecycle import Lifecycle
from worker_service.reconciler import Reconciler
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import RunnerState
from worker_service.runners.push_relay import PushRelay
from worker_service.state_store import StateStore
from worker_service.weight_push import PushStore

logger = logging.getLogger(__name__)
INFO_TIMEOUT_S = 2.0


class ModelController:
    """Keeps the desired state and drives the runners to it. ``wakeup`` tells the dispatcher to look
    again."""

    def __init__(self, pool: RunnerPool, gate: ExecutionGate, lifecycle: Lifecycle, model: str, dtype: int,
                 wakeup: asyncio.Event, store: StateStore, pushes: PushStore,
                 acceleration: common_pb2.Acceleration | None = None,
                 parallel: common_pb2.Parallelism | None = None,
                 overrides: Sequence[common_pb2.ComponentOverride] = (),
                 fused: Sequence[common_pb2.FusedAdapter] = (),
                 on_outputs_change: Callable[[], None] = lambda: None) -> None:
        """``on_outputs_change`` hears of every operation that may change what the runners output
        and of every (re-)apply of the desired state to a runner (the result cache drops its
        entries), once no batch runs there and before the operation acts."""
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
        self._reconciler = Reconciler(pool, gate, lifecycle, lambda: self.desired, store, pushes, self.refresh,
                                      on_outputs_change)
        self._fan_out = FanOut(pool, gate, self.refresh, self._follow_runners, on_outputs_change)

    def start(self) -> None:
        """Follows the runners; each one that appears gets the desired state, and one found holding
        something else (someone called it directly) gets it again."""
        self._pool.start(self._reconciler.on_runner_change, self._reconciler.check_runner)

    async def refresh(self) -> None:
        """Publishes the lifecycle state and wakes the dispatcher."""
        await self._lifecycle.publish()
        self._wakeup.set()

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
        async with self._fan_out.exclusive():
            previous = self.desired
            desired = self.desired = DesiredState.loading(model, dtype, acceleration, parallel, overrides, fused)
            if previous is not None and previous.model == model:
                desired.adapters = list(previous.adapters)
            await self._lifecycle.begin_loading(model)
            try:
                done = await self._fan_out.on_all(lambda r: self._reconciler.apply(r, desired, timeout=timeout))
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
        # A level-1 sleep keeps the weights bit for bit; level 2 drops them (and weight updates).
        async with self._fan_out.exclusive(changes_outputs=level == 2):
            done = await self._fan_out.on_all(lambda r: r.call(r.stub.Sleep(
                runner_pb2.RunnerServiceSleepRequest(level=level, tags=tags), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            reply: runner_pb2.RunnerServiceSleepResponse = done[0][1]
            reply.freed_bytes = sum(d[1].freed_bytes for d in done)
            reply.weight_bytes_released = sum(d[1].weight_bytes_released for d in done)
            self._follow(reply.info, level)
            return reply

    async def wake_up(self, tags: list[str], timeout: float | None = None) -> runner_pb2.RunnerServiceWakeUpResponse:
        # A wake from level 2 loads the weights again from the model's source.
        async with self._fan_out.exclusive(changes_outputs=self.desired is not None and self.desired.sleep_level == 2):
            done = await self._fan_out.on_all(lambda r: r.call(r.stub.WakeUp(
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
        async with self._fan_out.exclusive():
            done = await self._fan_out.on_all(lambda r: r.call(r.stub.LoadWeights(
                runner_pb2.RunnerServiceLoadWeightsRequest(path=path), timeout=timeout)))
            for runner, result in done:
                runner.weights_changed(result.weights_version)
            reply: runner_pb2.RunnerServiceLoadWeightsResponse = done[0][1]
            if self.desired is not None and reply.loaded_names:
                self.desired.add_update(WeightUpdate(path, reply.update.digest, names=tuple(reply.loaded_names)))
                self._changed()
            return reply

    def adapter_names(self) -> frozenset[str]:
        return frozenset(self.adapter_kinds())

    def adapter_kinds(self) -> dict[str, int]:
        """The registered adapters' names and kinds (common_pb2.AdapterKind)."""
        return {a.name: a.kind for a in self.desired.adapters} if self.desired is not None else {}

    async def load_adapter(self, name: str, path: str, pin: bool, timeout: float | None = None,
                           kind: int = common_pb2.ADAPTER_KIND_UNSPECIFIED) -> common_pb2.AdapterInfo:
        """Registers an adapter of ``kind`` (a LoRA, a ControlNet or an IP-Adapter) on every runner,
        between batches, and remembers it for re-apply."""
        async with self._fan_out.exclusive():
            desired = self._require_desired()
            done = await self._fan_out.on_all(lambda r: r.call(r.stub.LoadAdapter(
                runner_pb2.RunnerServiceLoadAdapterRequest(name=name, path=path, pin=pin, kind=kind),  # type: ignore[arg-type]
                timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            adapter: common_pb2.AdapterInfo = done[0][1].adapter
            desired.with_adapter(RegisteredAdapter(name, path, pin, adapter.digest, kind))
            self._changed()
            return adapter

    async def unload_adapter(self, name: str, timeout: float | None,
                             on_unloaded: Callable[[Collection[str]], None]) -> None:
        """Unregisters an adapter on every runner once the batches running now (which may use it)
        are done. ``on_unloaded`` runs before the dispatcher may start another batch: the caller
        ends the queued requests that name the adapter, which can no longer run."""
        logger.info("adapter %s: unloading once the batches running now are done", name)
        async with self._fan_out.exclusive():
            desired = self._require_desired()
            if name not in self.adapter_names():
                raise not_found(f"adapter {name!r} is not registered")
            done = await self._fan_out.on_all(lambda r: r.call(r.stub.UnloadAdapter(
                runner_pb2.RunnerServiceUnloadAdapterRequest(name=name), timeout=timeout)))
            for runner, result in done:
                runner.on_reply(result.info)
            desired.without_adapter(name)
            self._changed()
            on_unloaded([name])

    async def push_weights(self, requests: AsyncIterator[bytes],
                           timeout: float | None = None) -> worker_pb2.PushWeightsResponse:
        """Relays a PushWeights stream (serialized messages, checked and relayed as received: the
        runner's request has the same wire form) to every reachable runner while it arrives, keeping
        it on disk; at the client's commit, commits it on all of them together, between batches: each runner
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
            async for message, _ in reader.chunks(requests):
                push.write(message)
                for relay in relays:
                    await relay.send(message)
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
        async with self._fan_out.exclusive():
            by_runner = {relay.runner: relay for relay in relays}
            done = await self._fan_out.on_all(lambda r: by_runner[r].commit(commit), targets=list(by_runner))
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
        done = await self._fan_out.on_all(lambda r: r.call(r.stub.GetWeightsChecksum(
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
