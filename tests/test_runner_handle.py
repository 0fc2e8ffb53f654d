"""The worker's runner handle and gate: every state transition, each through the handle's own
methods, against the in-process fake runner (its info, and a served one followed by the pool's
Watch and probe). No torch, no processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from diffusion.v1 import common_pb2, runner_pb2
from fake_runner import FakeRunner, serve_fake_runner
from serving_common.errors import ServiceError
from worker_service.runners import ChannelSettings, RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import CallOutcome, RunnerState

pytestmark = pytest.mark.unit

S = RunnerState
CODE = grpc.StatusCode


def loaded_info(fake: FakeRunner) -> common_pb2.RunnerInfo:
    """What the fake reports once it holds a model."""
    fake.model = common_pb2.ModelInfo(source="tiny", components=[common_pb2.ComponentInfo(name="unet")])
    return fake.info()


def handle() -> tuple[RunnerHandle, list[RunnerState]]:
    """A handle whose listener records each state it is told of."""
    told: list[RunnerState] = []
    return RunnerHandle("unix:/nowhere.sock", ChannelSettings(), listener=lambda r: told.append(r.state)), told


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_apply_transitions_and_what_the_listener_is_told() -> None:
    async def scenario() -> None:
        runner, told = handle()
        fake = FakeRunner()
        assert runner.state is S.DISCONNECTED and not runner.ready and runner.room(4) == 0
        runner.on_watch(fake.info())
        assert runner.state is S.CONNECTED and runner.connected and runner.instance_id == fake.instance_id
        runner.apply_begun()
        assert runner.state is S.APPLYING
        runner.applied(loaded_info(fake))
        assert runner.state is S.READY and runner.room(4) == 4 and runner.info is not None
        assert runner.info.model.source == "tiny"
        runner.missed()  # the desired state changed without it
        assert runner.state is S.CONNECTED
        runner.apply_begun()
        runner.apply_refused("no such model")
        assert runner.state is S.REFUSED and runner.refusal == "no such model" and runner.room(4) == 0
        runner.on_poll(fake.info())  # the same instance answers: still refused
        assert runner.state is S.REFUSED
        runner.applied()  # an operation brought it to the desired state
        assert runner.state is S.READY and runner.refusal == ""
        runner.detach()
        assert runner.state is S.DETACHING and runner.room(4) == 0
        runner.on_watch(None)  # nothing brings a detaching runner back
        assert runner.state is S.DETACHING
        assert told == [S.CONNECTED, S.APPLYING, S.READY, S.CONNECTED, S.APPLYING, S.REFUSED, S.READY,
                        S.DETACHING]
        await runner.close()

    asyncio.run(scenario())


def test_watch_updates_count_restarts_and_a_new_instance_clears_a_refusal() -> None:
    async def scenario() -> None:
        runner, told = handle()
        first = FakeRunner()
        runner.on_watch(first.info())
        runner.applied(loaded_info(first))
        runner.on_watch(None)
        assert runner.state is S.DISCONNECTED and runner.info is None and runner.restarts == 0
        runner.on_watch(first.info())  # the same process back (a network blip): it still holds the state
        assert runner.state is S.READY and runner.restarts == 0
        runner.apply_refused("digest differs")
        runner.on_watch(None)
        second = FakeRunner()
        runner.on_watch(second.info())
        assert runner.state is S.CONNECTED and runner.restarts == 1 and runner.refusal == ""
        runner.applied(loaded_info(second))
        runner.on_poll(FakeRunner().info())  # a third process, seen by the poller before the Watch
        assert runner.state is S.CONNECTED and runner.restarts == 2
        assert told == [S.CONNECTED, S.READY, S.DISCONNECTED, S.READY, S.REFUSED, S.DISCONNECTED, S.CONNECTED,
                        S.READY, S.CONNECTED]
        await runner.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("code", "changes_state", "outcome", "after"), [
    (CODE.OK, False, CallOutcome.OK, S.READY),
    (CODE.UNAVAILABLE, False, CallOutcome.LOST, S.SUSPECT),
    (CODE.CANCELLED, False, CallOutcome.LOST, S.SUSPECT),
    (CODE.DEADLINE_EXCEEDED, False, CallOutcome.FAILED, S.READY),
    (CODE.INVALID_ARGUMENT, False, CallOutcome.FAILED, S.READY),
    (CODE.UNAVAILABLE, True, CallOutcome.LOST, S.SUSPECT),
    (CODE.CANCELLED, True, CallOutcome.UNKNOWN, S.CONNECTED),
    (CODE.DEADLINE_EXCEEDED, True, CallOutcome.UNKNOWN, S.CONNECTED),
    (CODE.FAILED_PRECONDITION, True, CallOutcome.FAILED, S.READY),
])
def test_call_outcomes_are_sorted_once_for_every_caller(code: grpc.StatusCode, changes_state: bool,
                                                        outcome: CallOutcome, after: RunnerState) -> None:
    async def scenario() -> None:
        runner, _ = handle()
        fake = FakeRunner()
        runner.on_watch(fake.info())
        runner.applied(loaded_info(fake))
        assert runner.on_call_outcome(code, changes_state) is outcome
        assert runner.state is after
        if after is S.SUSPECT:
            # It answers again: trusted. A state-changing call it missed leaves it to be re-applied.
            assert runner.on_call_outcome(CODE.OK) is CallOutcome.OK
            assert runner.state is (S.CONNECTED if changes_state else S.READY)
        await runner.close()

    asyncio.run(scenario())


def test_a_call_failing_on_an_unreachable_runner_changes_nothing_and_lost_ends_an_apply() -> None:
    async def scenario() -> None:
        runner, _ = handle()
        assert runner.on_call_outcome(CODE.UNAVAILABLE) is CallOutcome.LOST
        assert runner.state is S.DISCONNECTED  # the Watch says when it is back
        fake = FakeRunner()
        runner.on_watch(fake.info())
        runner.apply_begun()
        runner.on_call_outcome(CODE.UNAVAILABLE, changes_state=True)
        assert runner.state is S.SUSPECT
        runner.on_poll(fake.info())
        assert runner.state is S.CONNECTED  # answering again, and the apply is to be done
        await runner.close()

    asyncio.run(scenario())


def test_wait_ready_is_woken_by_the_transition() -> None:
    async def scenario() -> None:
        runner, _ = handle()
        fake = FakeRunner()
        waiting = asyncio.create_task(runner.wait_ready(5))
        runner.on_watch(fake.info())
        runner.apply_begun()
        await asyncio.sleep(0)
        assert not waiting.done()  # connected and applying are not ready
        runner.applied(loaded_info(fake))
        assert await waiting is True
        runner.missed()
        refused = asyncio.create_task(runner.wait_ready(5))
        await asyncio.sleep(0)
        runner.apply_refused("digest differs")
        assert await refused is False
        runner.missed()
        runner.on_call_outcome(CODE.UNAVAILABLE)
        with pytest.raises(TimeoutError):
            await runner.wait_ready(0.01)
        await runner.close()

    asyncio.run(scenario())


def test_batches_are_counted_and_room_follows_them() -> None:
    class Batch:
        images = 2

        def preempt(self) -> None:
            raise AssertionError("not preempted here")

        async def wait(self, timeout: float) -> None:
            return None

    async def scenario() -> None:
        runner, _ = handle()
        fake = FakeRunner()
        runner.on_watch(fake.info())
        runner.applied(loaded_info(fake))
        batch = Batch()
        runner.batch_started(batch)
        assert runner.running == (batch,) and runner.batches == 1 and runner.room(4) == 0
        runner.batch_ended(batch)
        assert runner.running == () and runner.batches == 1 and runner.room(4) == 4
        await runner.close()

    asyncio.run(scenario())


# -- the pool's Watch and probe against a served fake runner -------------------------------------

class Served:
    """One fake runner served on ``target``, which a new fake process may replace."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = await serve_fake_runner(FakeRunner(), self.target)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


@asynccontextmanager
async def followed(tmp_path: Path) -> AsyncIterator[tuple[Served, RunnerHandle, list[RunnerState]]]:
    """A pool following one served fake runner; what its ``on_change`` heard."""
    served = Served(f"unix:{tmp_path}/runner.sock")
    await served.start()
    pool = RunnerPool([served.target], ChannelSettings(), ExecutionGate(on_open=lambda: None))
    heard: list[RunnerState] = []

    async def on_change(runner: RunnerHandle) -> None:
        heard.append(runner.state)

    pool.start(on_change)
    try:
        yield served, pool.runners[0], heard
    finally:
        await pool.close()
        await served.stop()


def test_the_watch_follows_a_runner_that_goes_and_comes_back_as_a_new_process(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with followed(tmp_path) as (served, runner, heard):
            await until(lambda: runner.state is S.CONNECTED)
            first = runner.instance_id
            runner.applied()
            await served.stop()
            await until(lambda: runner.state is S.DISCONNECTED)
            await served.start()
            await until(lambda: runner.state is S.CONNECTED, timeout=10)
            assert runner.restarts == 1 and runner.instance_id != first
            await until(lambda: heard == [S.CONNECTED, S.READY, S.DISCONNECTED, S.CONNECTED])

    asyncio.run(scenario())


def test_a_suspect_runner_is_probed_until_it_answers(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with followed(tmp_path) as (_, runner, heard):
            await until(lambda: runner.state is S.CONNECTED)
            runner.applied()
            assert runner.on_call_outcome(CODE.UNAVAILABLE) is CallOutcome.LOST
            assert runner.state is S.SUSPECT
            await until(lambda: runner.state is S.READY)  # the probe's GetInfo answered
            await until(lambda: heard[-2:] == [S.SUSPECT, S.READY])

    asyncio.run(scenario())


def test_call_raises_the_runners_error_and_tells_the_handle(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with followed(tmp_path) as (served, runner, _):
            await until(lambda: runner.state is S.CONNECTED)
            runner.applied()
            refused = runner_pb2.RunnerServiceLoadWeightsRequest(path="/w.safetensors", expected_digest="0" * 64)
            with pytest.raises(ServiceError) as caught:
                await runner.call(runner.stub.LoadWeights(refused))
            assert caught.value.code == CODE.FAILED_PRECONDITION and runner.state is S.READY  # it answered
            await served.stop()
            with pytest.raises(ServiceError) as gone:
                await runner.call(runner.stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=5), changes_state=False)
            assert gone.value.code == CODE.UNAVAILABLE
            assert runner.state in (S.SUSPECT, S.DISCONNECTED)  # whichever noticed first, the call or the Watch

    asyncio.run(scenario())


def test_attach_waits_for_ready_and_refusal_or_silence_removes_the_runner(tmp_path: Path) -> None:
    async def scenario() -> None:
        target = f"unix:{tmp_path}/attached.sock"
        server = await serve_fake_runner(FakeRunner(), target)
        pool = RunnerPool([], ChannelSettings(), ExecutionGate(on_open=lambda: None))

        async def refuse(runner: RunnerHandle) -> None:  # a controller whose desired state it refuses
            if runner.state is S.CONNECTED:
                runner.apply_begun()
                runner.apply_refused("digest differs")

        pool.start(refuse)
        try:
            with pytest.raises(ServiceError) as refused:
                await pool.attach(target, 5)
            assert refused.value.code == CODE.FAILED_PRECONDITION and "digest differs" in refused.value.message
            assert pool.runners == ()
            with pytest.raises(ServiceError) as silent:
                await pool.attach(f"unix:{tmp_path}/nobody.sock", 0.2)
            assert silent.value.code == CODE.UNAVAILABLE and pool.runners == ()
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(scenario())


# -- the gate ------------------------------------------------------------------------------------

def test_the_gate_pauses_executions_for_an_exclusive_operation_only() -> None:
    async def scenario() -> None:
        opened: list[bool] = []
        gate = ExecutionGate(on_open=lambda: opened.append(True))
        gate.execution_started()
        async with gate.serialized():  # one runner's apply: executions go on
            assert gate.busy and not gate.paused
        exclusive_entered = asyncio.Event()

        async def operation() -> None:
            async with gate.exclusive():
                exclusive_entered.set()

        task = asyncio.create_task(operation())
        await asyncio.sleep(0)
        assert gate.paused and not exclusive_entered.is_set()  # waits for the execution running
        gate.execution_finished()
        await task
        assert exclusive_entered.is_set() and not gate.paused and not gate.busy and opened == [True]

    asyncio.run(scenario())
