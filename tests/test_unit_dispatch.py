"""Fast tests of admission, batching, dispatch, retry and desired state against in-process fake
runners (no torch, no processes): the worker's own parts, driven through their public methods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health

from diffusion.v1 import common_pb2, worker_pb2
from fake_runner import FakeRunner, serve_fake_runner
from serving_common.errors import ServiceError
from worker_service.config import Limits
from worker_service.controller import ModelController
from worker_service.lifecycle import Lifecycle
from worker_service.runners import ChannelSettings, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.scheduling.admission import AdmissionQueue
from worker_service.scheduling.batching import BatchPolicy
from worker_service.scheduling.dispatcher import HEARTBEAT_PROGRESS_MS, Dispatcher
from worker_service.scheduling.jobs import Finished, Job
from worker_service.state_store import StateStore
from worker_service.validation import normalize
from worker_service.weight_push import PushStore

pytestmark = pytest.mark.unit

W = worker_pb2


@dataclass
class Parts:
    runners: list[FakeRunner]
    pool: RunnerPool
    controller: ModelController
    queue: AdmissionQueue
    dispatcher: Dispatcher
    lifecycle: Lifecycle


@asynccontextmanager
async def worker_parts(tmp_path: Path, runners: int = 1, batch: int = 4, delay_s: float = 0.0,
                       step_s: float = 0.0, step_schedules: tuple[str, ...] = (),
                       stall_s: float = 60.0) -> AsyncIterator[Parts]:
    """``step_schedules``: step-batching runners, one per schedule each reports (else ``runners``
    request-level ones)."""
    fakes = ([FakeRunner(step_s, step_batching=True, step_schedule=schedule) for schedule in step_schedules]
             or [FakeRunner(step_s) for _ in range(runners)])
    runners = len(fakes)
    targets = [f"unix:{tmp_path}/runner-{i}.sock" for i in range(runners)]
    servers = [await serve_fake_runner(fake, target) for fake, target in zip(fakes, targets, strict=True)]
    wakeup = asyncio.Event()
    gate = ExecutionGate(on_open=wakeup.set)
    pool = RunnerPool(targets, ChannelSettings(), gate)
    controller: ModelController
    lifecycle = Lifecycle(health.aio.HealthServicer(), pool, desired=lambda: controller.desired)
    controller = ModelController(pool, gate, lifecycle, "tiny", common_pb2.DTYPE_UNSPECIFIED, wakeup, StateStore(""),
                                 PushStore(str(tmp_path / "pushes"), 1 << 20))
    queue = AdmissionQueue(lifecycle, max_queue=16, auto_wake=False, wakeup=wakeup)
    dispatcher = Dispatcher(queue, pool, gate, controller, lifecycle, wakeup, BatchPolicy(batch, delay_s), 5.0,
                            stall_timeout_s=stall_s)
    task = asyncio.create_task(dispatcher.run())
    controller.start()
    parts = Parts(fakes, pool, controller, queue, dispatcher, lifecycle)
    try:
        await until(lambda: lifecycle.state == W.WORKER_STATE_READY and len(pool.ready()) == runners)
        yield parts
    finally:
        task.cancel()
        await pool.close()
        for server in servers:
            await server.stop(0)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def submit(parts: Parts, request_id: str, deadline_s: float | None = None, **fields: int) -> Job:
    request = normalize(W.GenerateRequest(request_id=request_id, seed=fields.pop("seed", 1),
                                          num_inference_steps=fields.pop("steps", 4), **fields),
                        Limits(), parts.queue.active)
    job = Job(request, deadline=None if deadline_s is None else time.monotonic() + deadline_s)
    parts.queue.submit(job)
    return job


async def outcome(job: Job) -> Finished | ServiceError:
    while True:
        event = await asyncio.wait_for(job.events.get(), 5)
        if isinstance(event, Finished | ServiceError):
            return event


def run(tmp_path: Path, scenario: Callable[[Parts], Awaitable[None]], **options: object) -> None:
    async def main() -> None:
        async with worker_parts(tmp_path, **options) as parts:  # type: ignore[arg-type]
            await scenario(parts)
    asyncio.run(main())


def test_compatible_requests_share_one_execute_and_keep_their_seeds(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        jobs = [submit(parts, f"r{i}", seed=10 + i) for i in range(3)] + [submit(parts, "wide", width=128)]
        results = [await outcome(j) for j in jobs]
        assert all(isinstance(r, Finished) for r in results)
        executes = parts.runners[0].executes
        assert [[item.request_id for item in e.items] for e in executes] == [["r0", "r1", "r2"], ["wide"]]
        seeds = [r.output.images[0].seed for r in results if isinstance(r, Finished)]
        assert seeds == [10, 11, 12, 1]

    run(tmp_path, scenario, delay_s=0.05)


@pytest.mark.parametrize(("stall_s", "heartbeat_ms"), [(60.0, HEARTBEAT_PROGRESS_MS), (0.2, 50)])
def test_progress_is_a_heartbeat_unless_a_client_streams_it(tmp_path: Path, stall_s: float, heartbeat_ms: int) -> None:
    """The runner sends every step only to a batch a client streams; others get a paced heartbeat,
    well inside the stall timeout."""
    async def scenario(parts: Parts) -> None:
        unstreamed = submit(parts, "plain")
        assert isinstance(await outcome(unstreamed), Finished)
        streamed = Job(normalize(W.GenerateRequest(request_id="streamed", seed=2, num_inference_steps=4), Limits(),
                                 parts.queue.active), deadline=None, stream=True)
        parts.queue.submit(streamed)
        assert isinstance(await outcome(streamed), Finished)
        executes = parts.runners[0].executes
        assert [(e.items[0].request_id, e.progress, e.progress_interval_ms) for e in executes] == [
            ("plain", True, heartbeat_ms), ("streamed", True, 0)]

    run(tmp_path, scenario, stall_s=stall_s)


def test_a_runner_taking_turns_by_compute_is_sent_requests_by_compute_and_sizes_take_turns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The runner reports --step-schedule budget, and the worker (no flag of its own) schedules by
    compute: max batch 2 of the largest size held (128x128), so beside one large request there is
    room for four of a quarter its pixels, where a count of images would take one. The second large
    one, whose class has the next turn, then waits for room before the fifth small one."""
    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        fake.steps_open = asyncio.Event()
        jobs = [submit(parts, "L1", width=128, height=128), submit(parts, "L2", width=128, height=128)]
        jobs += [submit(parts, f"s{i}", width=64, height=64) for i in range(1, 6)]
        await until(lambda: len(fake.executes) == 5)
        assert [e.items[0].request_id for e in fake.executes] == ["L1", "s1", "s2", "s3", "s4"]
        fake.steps_open.set()
        assert all(isinstance(result, Finished) for result in [await outcome(job) for job in jobs])
        assert [e.items[0].request_id for e in fake.executes][5:] == ["L2", "s5"]
        assert "scheduling by compute: every ready runner takes turns" in caplog.text

    caplog.set_level("INFO", "worker_service.scheduling.dispatcher")
    run(tmp_path, scenario, batch=2, step_schedules=("budget",))


def test_a_pool_whose_runners_do_not_all_take_turns_is_scheduled_in_order(tmp_path: Path) -> None:
    """One runner takes turns by compute, the other steps every size at every step: the worker
    sends in order, by images, so the two large requests fill the first runner's room of 2 and the
    small ones the other's (by compute, the small ones would have joined the first large one)."""
    async def scenario(parts: Parts) -> None:
        for fake in parts.runners:
            fake.steps_open = asyncio.Event()
        jobs = [submit(parts, "L1", width=128, height=128), submit(parts, "L2", width=128, height=128)]
        jobs += [submit(parts, f"s{i}", width=64, height=64) for i in range(1, 4)]
        await until(lambda: sum(len(fake.executes) for fake in parts.runners) == 4)
        sent = sorted([e.items[0].request_id for e in fake.executes] for fake in parts.runners)
        assert sent == [["L1", "L2"], ["s1", "s2"]]
        for fake in parts.runners:
            assert fake.steps_open is not None
            fake.steps_open.set()
        assert all(isinstance(result, Finished) for result in [await outcome(job) for job in jobs])

    run(tmp_path, scenario, batch=2, step_schedules=("budget", "all"))


def test_a_batch_whose_runner_dies_is_retried_once(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        fake.execute_failures, fake.fail_after_steps = [grpc.StatusCode.UNAVAILABLE], 2
        first = await outcome(submit(parts, "survivor"))
        assert isinstance(first, Finished) and len(fake.executes) == 2
        await until(lambda: bool(parts.pool.ready()))  # the probe cleared the suspicion

    run(tmp_path, scenario)


def test_a_runner_stuck_in_a_step_is_not_ready_and_never_handed_its_batch_again_until_the_step_ends(
        tmp_path: Path) -> None:
    """No progress for the stall timeout: the runner answers GetInfo (its server is alive) but reports
    its device busy since before the stall, so it stays out of readiness while the probe asks; once the
    step ends, it is ready again and the batch is retried there."""
    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        fake.steps_open = asyncio.Event()
        job = submit(parts, "stuck")
        await until(lambda: not parts.pool.ready() and job.attempts == 1 and job.batch is None)
        asked = fake.info_calls
        await until(lambda: fake.info_calls >= asked + 2)  # probed twice: still stuck, still out
        assert not parts.pool.ready() and len(fake.executes) == 1 and job.outcome is None
        assert parts.lifecycle.state != W.WORKER_STATE_READY
        fake.steps_open.set()
        assert isinstance(await outcome(job), Finished)
        assert len(fake.executes) == 2

    run(tmp_path, scenario, stall_s=0.2)


def test_a_cancel_falling_as_a_response_arrives_still_stops_the_runner(tmp_path: Path) -> None:
    """Python 3.11's asyncio.wait_for swallows a cancel that falls as the future it waits on completes:
    a dropped request whose cancel fell as a progress response arrived ran to its end on the runner.
    Dropped at every point of a fast stream of progress, each stops the runner's call."""
    drops = 40

    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        fake.step_s = 0.001  # 500 steps: far more than pass before a cancel lands
        for index in range(drops):
            job = submit(parts, f"drop-{index}", steps=500)
            await until(lambda: job.step >= 1 + index % 3)  # noqa: B023 - awaited within the iteration
            assert parts.queue.cancel(job.request.request_id, ServiceError(grpc.StatusCode.CANCELLED, "dropped"))
        await until(lambda: len(fake.stopped) + len(fake.ran_to_end) == drops, timeout=30)
        assert fake.ran_to_end == []

    run(tmp_path, scenario)


def test_a_second_failure_ends_unavailable_with_both_reasons(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        fake.execute_failures = [grpc.StatusCode.UNAVAILABLE] * 2
        failure = await outcome(submit(parts, "unlucky"))
        assert isinstance(failure, ServiceError) and failure.code == grpc.StatusCode.UNAVAILABLE
        assert "not retried again" in failure.message and len(fake.executes) == 2

    run(tmp_path, scenario)


def test_no_retry_when_the_deadline_leaves_no_time_for_one(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        fake = parts.runners[0]
        assert isinstance(await outcome(submit(parts, "pace", steps=20)), Finished)  # 20 steps of 10 ms seen
        fake.execute_failures, fake.fail_after_steps = [grpc.StatusCode.UNAVAILABLE], 10
        failure = await outcome(submit(parts, "late", steps=20, deadline_s=0.25))
        assert isinstance(failure, ServiceError) and failure.code == grpc.StatusCode.UNAVAILABLE
        assert "not retried:" in failure.message and len(fake.executes) == 2

    run(tmp_path, scenario, step_s=0.01)


def test_a_request_refused_by_the_runner_is_not_retried(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        parts.runners[0].execute_failures = [grpc.StatusCode.INVALID_ARGUMENT]
        failure = await outcome(submit(parts, "refused"))
        assert isinstance(failure, ServiceError) and failure.code == grpc.StatusCode.INVALID_ARGUMENT
        assert len(parts.runners[0].executes) == 1

    run(tmp_path, scenario)


def test_batches_spread_over_idle_runners(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        jobs = [submit(parts, f"r{i}", width=64 + 8 * i) for i in range(4)]  # four shapes: four batches
        results = [await outcome(j) for j in jobs]
        assert all(isinstance(r, Finished) for r in results)
        assert all(fake.executes for fake in parts.runners)

    run(tmp_path, scenario, runners=2, step_s=0.01)


def test_cancel_takes_a_queued_request_out_and_a_full_queue_refuses(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        running = submit(parts, "running", steps=50)
        await until(lambda: running.batch is not None)
        queued = submit(parts, "queued", width=128)
        failure = ServiceError(grpc.StatusCode.CANCELLED, "cancelled by the test")
        assert parts.queue.cancel("queued", failure) == "queued"
        assert await outcome(queued) is failure and "queued" not in [j.request.request_id for j in parts.queue.jobs]
        assert parts.queue.cancel("running", failure) == "running"
        assert await outcome(running) is failure
        await until(lambda: parts.dispatcher.in_flight == 0)  # the abandoned batch stopped
        assert parts.queue.cancel("nobody", failure) is None

    run(tmp_path, scenario, step_s=0.01)


def test_level_2_sleep_forgets_the_updates_the_runner_dropped(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        controller = parts.controller
        await controller.load_weights("/weights/a.safetensors")
        assert controller.desired is not None and len(controller.desired.weight_updates) == 1
        await controller.sleep(1, [])
        assert len(controller.desired.weight_updates) == 1  # level 1 keeps them
        await controller.wake_up([])
        await controller.sleep(2, ["vae"])
        assert len(controller.desired.weight_updates) == 1  # the update touched only the unet
        await controller.sleep(2, ["unet"])
        assert controller.desired.weight_updates == []
        assert parts.lifecycle.state == W.WORKER_STATE_SLEEPING

    run(tmp_path, scenario)


def test_a_refused_init_leaves_the_model_serving_and_the_runner_ready(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        with pytest.raises(ServiceError) as refused:
            await parts.controller.init("/no/such/model", common_pb2.DTYPE_UNSPECIFIED)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        model = parts.lifecycle.model
        assert parts.lifecycle.state == W.WORKER_STATE_READY and model is not None and model.source == "tiny"
        assert parts.pool.runners[0].ready and parts.controller.desired is not None
        assert parts.controller.desired.model == "tiny"
        assert isinstance(await outcome(submit(parts, "after")), Finished)

    run(tmp_path, scenario)


def test_an_attached_runner_gets_the_desired_state_and_a_detached_one_leaves(tmp_path: Path) -> None:
    async def scenario(parts: Parts) -> None:
        await parts.controller.load_weights("/weights/a.safetensors")
        fake, target = FakeRunner(), f"unix:{tmp_path}/attached.sock"
        server = await serve_fake_runner(fake, target)
        try:
            runner = await parts.pool.attach(target, 5)
            assert runner.ready and fake.model is not None and fake.model.source == "tiny"
            assert [u.digest for u in fake.updates] == [u.digest for u in parts.runners[0].updates]
            assert runner.info is not None and parts.lifecycle.weights_version == runner.info.weights_version != ""
            await parts.pool.detach(target, drain=True)
            assert parts.pool.find(target) is None and parts.lifecycle.state == W.WORKER_STATE_READY
        finally:
            await server.stop(0)

    run(tmp_path, scenario)
