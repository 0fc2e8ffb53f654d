"""The runner's core in this process: the device gate is the one owner of exclusive access
(exclusive users one at a time, the step engine kept out while one is announced, one device
thread, abandoned work holding the device until it is done), and on a real ``ModelHost`` with the
tiny model a weight change asked for mid-batch lands between that batch and the next request."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from runner_service.device_gate import CallWatch, DeviceGate
from serving_common.errors import ServiceError
from tests.runner_calls import item


async def yield_to_others() -> None:
    """Lets every task that can run take its turn (and block where it must)."""
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.unit
def test_exclusive_users_hold_the_device_one_at_a_time():
    async def scenario() -> list[str]:
        gate, order = DeviceGate(), []
        inside, release = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with gate.exclusive():
                order.append("first in")
                inside.set()
                await release.wait()
                order.append("first out")

        async def second() -> None:
            async with gate.exclusive():
                order.append("second in")

        tasks = [asyncio.create_task(first())]
        await inside.wait()
        tasks.append(asyncio.create_task(second()))
        await yield_to_others()
        assert gate.busy and order == ["first in"]
        release.set()
        await asyncio.gather(*tasks)
        assert not gate.busy and not gate.exclusive_waiting
        return order

    assert asyncio.run(scenario()) == ["first in", "first out", "second in"]


@pytest.mark.unit
def test_an_announced_exclusive_user_keeps_the_step_engine_out_until_it_is_done():
    async def scenario() -> list[str]:
        gate, order = DeviceGate(), []
        release = asyncio.Event()

        async def operation() -> None:
            async with gate.exclusive():
                order.append("operation")
                await release.wait()

        async def next_steps() -> None:
            async with gate.steps():
                order.append("steps")

        async with gate.steps():  # a step batch is running
            tasks = [asyncio.create_task(operation())]
            await yield_to_others()
            assert gate.exclusive_waiting and order == []  # it waits for the batch to drain
            tasks.append(asyncio.create_task(next_steps()))
            await yield_to_others()
        # The batch drained: the operation has the device, and the engine stays out until it ends.
        await yield_to_others()
        assert order == ["operation"]
        release.set()
        await asyncio.gather(*tasks)
        assert not gate.exclusive_waiting
        return order

    assert asyncio.run(scenario()) == ["operation", "steps"]


@pytest.mark.unit
def test_all_device_work_runs_on_one_thread():
    async def scenario() -> tuple[threading.Thread, threading.Thread]:
        gate = DeviceGate()
        async with gate.steps():
            stepping = await gate.run(threading.current_thread)
        alone = await gate.run_alone(CallWatch("GetWeightsChecksum"), threading.current_thread)
        return stepping, alone

    stepping, alone = asyncio.run(scenario())
    assert stepping is alone and stepping is not threading.current_thread()
    assert stepping.name.startswith("device")


@pytest.mark.unit
def test_work_whose_call_ended_changes_nothing_and_holds_the_device_until_done():
    gate, watch = DeviceGate(), CallWatch("Sleep")
    started, go = threading.Event(), threading.Event()
    outcome: list[object] = []

    def work() -> None:
        started.set()
        go.wait()
        try:
            watch.before_change()
        except ServiceError as error:
            outcome.append(error.code)
            raise
        outcome.append("changed")

    async def scenario() -> None:
        call = asyncio.create_task(gate.run_alone(watch, work))
        await asyncio.to_thread(started.wait)
        call.cancel()
        await yield_to_others()
        assert gate.busy  # the thread cannot be stopped: nothing else gets the device meanwhile
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not gate.busy

    asyncio.run(scenario())
    assert outcome == [grpc.StatusCode.CANCELLED]


@pytest.mark.unit
def test_a_call_past_its_deadline_may_not_change_the_model():
    CallWatch("LoadWeights").before_change()  # no deadline: it may
    with pytest.raises(ServiceError) as error:
        CallWatch("LoadWeights", 0.0).before_change()
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.value.message == "LoadWeights abandoned: the call's deadline passed; nothing changed"


@pytest.mark.process
def test_a_weight_push_asked_for_mid_batch_lands_between_the_batch_and_the_next_request(cpu_platform):
    from runner_service.config import RunnerConfig
    from runner_service.core import ModelHost
    from runner_service.execution import BatchResult, StepProgress

    steps = 4

    async def result_of(host: ModelHost, events) -> BatchResult:
        async for event in events:
            if isinstance(event, BatchResult):
                return event
        raise AssertionError("no result")

    async def scenario() -> None:
        host = ModelHost(cpu_platform, RunnerConfig())
        await host.load("tiny", None)
        assert host.model is not None and host.step_batched_tasks(host.model)
        old = host.model.weights_version
        batch = [item(seed=1, steps=steps)]
        reference = await result_of(host, host.execute(batch, progress=False))

        running = host.execute(batch, progress=True)
        first = await anext(running)
        assert isinstance(first, StepProgress) and first.step < steps
        conv_in = host.model.components["unet"].module.conv_in.weight
        push = asyncio.create_task(host.apply_push({"unet.conv_in.weight": conv_in.detach() + 1.0}, "perturbed",
                                                   CallWatch("PushWeights")))
        while not host.gate.exclusive_waiting:
            await asyncio.sleep(0)
        # Asked for after the push: it may not join the running batch, and runs on the new weights.
        following = asyncio.create_task(result_of(host, host.execute([item(seed=2, steps=1)], progress=False)))
        rest = [event async for event in running]
        loaded, _ = await push
        after = await following

        assert any(isinstance(event, StepProgress) and event.step < steps for event in rest)  # mid-batch
        result = rest[-1]
        assert isinstance(result, BatchResult) and result.weights_version == old
        assert np.array_equal(result.outputs[0].pixels, reference.outputs[0].pixels)  # untouched by the push
        assert loaded.weights_version != old and after.weights_version == loaded.weights_version

    asyncio.run(scenario())


@pytest.mark.process
def test_the_device_thread_runs_a_lone_requests_steps_without_returning_to_the_event_loop(cpu_platform):
    """Nothing arrives and no call ends: one hand-off to the device thread runs every step, and each
    step's progress still reaches the caller, in order."""
    from runner_service.config import RunnerConfig
    from runner_service.core import ModelHost
    from runner_service.denoising.prompt_cache import PromptCache
    from runner_service.execution import BatchResult, StepProgress
    from runner_service.progress_pacing import ProgressPacing
    from runner_service.step_engine import StepEngine

    class CountingGate(DeviceGate):
        """The gate, counting the hand-offs of work to the device thread."""

        hand_offs = 0

        async def run(self, work, callers=()):
            self.hand_offs += 1
            return await super().run(work, callers)

    steps = 12

    async def scenario() -> tuple[list[object], int]:
        host = ModelHost(cpu_platform, RunnerConfig())
        await host.load("tiny", None)
        gate = CountingGate()
        engine = StepEngine(gate, host.slot.require, host.limits, PromptCache(1 << 20))
        events = [event async for event in engine.execute([item(seed=1, steps=steps)], ProgressPacing())]
        return events, gate.hand_offs

    events, hand_offs = asyncio.run(scenario())
    assert [event.step for event in events[:-1] if isinstance(event, StepProgress)] == list(range(1, steps + 1))
    assert isinstance(events[-1], BatchResult) and len(events) == steps + 1
    assert hand_offs == 1


@pytest.mark.process
def test_a_request_level_call_is_sent_the_steps_its_pacing_lets_through(cpu_platform):
    """Request by request (the pipeline's own loop and callback), as the step engine does: with an
    hour between messages, a call is sent its first and last steps only."""
    from runner_service.config import RunnerConfig
    from runner_service.core import ModelHost
    from runner_service.execution import BatchResult, StepProgress

    async def scenario() -> list[object]:
        host = ModelHost(cpu_platform, RunnerConfig(batching="request"))
        await host.load("tiny", None)
        assert host.model is not None and not host.step_batched_tasks(host.model)
        return [event async for event in host.execute([item(seed=1, steps=6)], True, progress_interval_ms=3_600_000)]

    events = asyncio.run(scenario())
    assert [event.step for event in events if isinstance(event, StepProgress)] == [1, 6]
    assert isinstance(events[-1], BatchResult) and len(events) == 3
