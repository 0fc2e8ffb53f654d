"""Fast tests of the worker's pure logic: batch selection, the retry estimate, lifecycle states
and request validation. No processes, no network; all of them run in well under a second."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.protocol import WORKER_SERVICE, image_seed
from worker_service.config import FALLBACK_GUIDANCE, Limits
from worker_service.desired_state import DesiredState
from worker_service.lifecycle import Lifecycle
from worker_service.runners import ChannelSettings, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.scheduling.batching import DEADLINE_AGING_S, BatchPolicy, retry_seconds, select_batch, serving_order
from worker_service.scheduling.jobs import Job
from worker_service.validation import ValidationError, normalize

pytestmark = pytest.mark.unit

W = worker_pb2


def job(request_id: str, size: int = 64, steps: int = 4, images: int = 1, admitted_at: float = 0.0,
        attempts: int = 0, adapter: str = "", deadline: float | None = None) -> Job:
    adapters = [common_pb2.AdapterRef(name=adapter, scale=0.5)] if adapter else []
    request = normalize(W.GenerateRequest(request_id=request_id, width=size, height=size, num_inference_steps=steps,
                                          num_images=images, seed=1, adapters=adapters), Limits(), (),
                        adapters={"style", "ink"})
    return Job(request, deadline=deadline, admitted_at=admitted_at, attempts=attempts)


# -- batch selection ----------------------------------------------------------------------------

def ids(jobs: list[Job]) -> list[str]:
    return [j.request.request_id for j in jobs]


def test_the_head_and_compatible_requests_batch_in_queue_order() -> None:
    queue = [job("a"), job("b", size=128), job("c"), job("d", steps=8), job("e")]
    batch, wait = select_batch(queue, BatchPolicy(max_batch_size=4, max_batch_delay=0.0), now=1.0)
    assert ids(batch) == ["a", "c", "e"] and wait is None


def test_a_batch_holds_at_most_max_batch_size_images() -> None:
    queue = [job("a", images=2), job("b", images=3), job("c", images=2), job("d")]
    batch, _ = select_batch(queue, BatchPolicy(max_batch_size=4, max_batch_delay=0.0), now=1.0)
    assert ids(batch) == ["a", "c"]


def test_the_head_waits_for_the_batch_to_fill_within_the_delay_only() -> None:
    policy = BatchPolicy(max_batch_size=4, max_batch_delay=0.010)
    batch, wait = select_batch([job("a", admitted_at=1.0)], policy, now=1.004)
    assert batch == [] and wait == pytest.approx(0.006)
    batch, wait = select_batch([job("a", admitted_at=1.0)], policy, now=1.011)
    assert ids(batch) == ["a"] and wait is None


def test_a_full_batch_or_a_retried_head_never_waits() -> None:
    policy = BatchPolicy(max_batch_size=2, max_batch_delay=10.0)
    full, _ = select_batch([job("a", admitted_at=1.0), job("b", admitted_at=1.0)], policy, now=1.0)
    assert ids(full) == ["a", "b"]
    retried, wait = select_batch([job("a", admitted_at=1.0, attempts=1)], policy, now=1.0)
    assert ids(retried) == ["a"] and wait is None


def test_an_incompatible_head_is_never_starved() -> None:
    queue = [job("odd", size=128), *(job(f"n{i}") for i in range(8))]
    batch, _ = select_batch(queue, BatchPolicy(max_batch_size=4, max_batch_delay=0.0), now=1.0)
    assert ids(batch) == ["odd"]


def test_only_requests_with_the_same_adapters_batch_and_none_is_starved() -> None:
    policy = BatchPolicy(max_batch_size=4, max_batch_delay=0.0)
    queue = [job("s1", adapter="style"), job("b1"), job("s2", adapter="style"), job("i1", adapter="ink"), job("b2")]
    batch, _ = select_batch(queue, policy, now=1.0)
    assert ids(batch) == ["s1", "s2"]
    rest = [j for j in queue if j not in batch]
    assert ids(select_batch(rest, policy, now=1.0)[0]) == ["b1", "b2"]  # then the head: no adapters



def test_requests_of_different_true_cfg_scales_never_share_a_pipeline_call() -> None:
    def scaled(request_id: str, scale: float) -> Job:
        queued = job(request_id)
        queued.request = dataclasses.replace(queued.request, true_cfg_scale=scale)
        return queued

    queue = [scaled("cfg4-a", 4.0), scaled("cfg2", 2.0), scaled("cfg4-b", 4.0)]
    batch, _ = select_batch(queue, BatchPolicy(max_batch_size=4, max_batch_delay=0.0), now=1.0)
    assert ids(batch) == ["cfg4-a", "cfg4-b"]


def test_a_step_batching_runner_gets_what_fits_its_room_without_waiting_to_fill() -> None:
    policy = BatchPolicy(max_batch_size=4, max_batch_delay=10.0)
    queue = [job("a", admitted_at=1.0), job("b", admitted_at=1.0), job("c", admitted_at=1.0)]
    batch, wait = select_batch(queue, policy, now=1.0, room=2, fill=False)
    assert ids(batch) == ["a", "b"] and wait is None


def test_deadline_scheduling_runs_the_earliest_deadline_first_and_ages_the_rest() -> None:
    policy = BatchPolicy(max_batch_size=1, max_batch_delay=0.0, by_deadline=True)
    queue = [job("none", admitted_at=1.0), job("late", admitted_at=2.0, deadline=30.0),
             job("soon", admitted_at=3.0, deadline=5.0, size=128)]
    assert ids(serving_order(queue, policy)) == ["soon", "late", "none"]
    assert ids(select_batch(serving_order(queue, policy), policy, now=4.0)[0]) == ["soon"]
    # Without a deadline a request is due DEADLINE_AGING_S after it arrived: before a later deadline.
    far = [job("none", admitted_at=1.0), job("later", admitted_at=2.0, deadline=1.0 + DEADLINE_AGING_S + 1)]
    assert ids(serving_order(far, policy)) == ["none", "later"]
    assert ids(serving_order(queue, BatchPolicy(max_batch_size=1, max_batch_delay=0.0))) == ids(queue)


# -- the retry estimate ---------------------------------------------------------------------------

def test_the_retry_estimate_uses_this_attempts_pace_or_the_last_one_seen() -> None:
    assert retry_seconds(elapsed_ms=500.0, step=5, total_steps=20, last_ms_per_step=999.0) == pytest.approx(2.0)
    assert retry_seconds(elapsed_ms=0.0, step=0, total_steps=20, last_ms_per_step=50.0) == pytest.approx(1.0)
    assert retry_seconds(elapsed_ms=0.0, step=0, total_steps=20, last_ms_per_step=0.0) == 0.0


# -- lifecycle states ---------------------------------------------------------------------------

async def readiness(servicer: health.aio.HealthServicer) -> int:
    class Context:
        async def abort(self, code: object, details: str) -> None:
            raise AssertionError(details)
    reply = await servicer.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), Context())
    return reply.status


def runner_info(asleep: bool = False, loaded: bool = True) -> common_pb2.RunnerInfo:
    info = common_pb2.RunnerInfo(instance_id="i1", weights_version="v1" if loaded else "")
    if loaded:
        info.model.CopyFrom(common_pb2.ModelInfo(source="tiny", sleep_level=1 if asleep else 0, components=[
            common_pb2.ComponentInfo(name="unet", asleep=asleep), common_pb2.ComponentInfo(name="vae")]))
    return info


def test_lifecycle_states_follow_the_runners_and_readiness_follows_ready() -> None:
    """The model, what is asleep and the weights version are read from a runner that holds the
    desired state; loading, the failure and draining are the lifecycle's own facts."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def walk() -> None:
        servicer = health.aio.HealthServicer()
        pool = RunnerPool(["r1"], ChannelSettings(), ExecutionGate(on_open=lambda: None))
        desired: list[DesiredState | None] = [None]
        lifecycle = Lifecycle(servicer, pool, desired=lambda: desired[0])
        runner = pool.runners[0]
        seen = []
        await lifecycle.publish()
        seen.append((lifecycle.state, lifecycle.message))
        runner.on_watch(runner_info(loaded=False))
        runner.applied()  # no desired model: nothing to apply
        seen.append((lifecycle.state, lifecycle.message))
        await lifecycle.begin_loading("tiny")
        seen.append((lifecycle.state, lifecycle.message))
        desired[0] = DesiredState("tiny", common_pb2.DTYPE_UNSPECIFIED)
        runner.applied(runner_info())
        await lifecycle.loaded()
        seen.append((lifecycle.state, lifecycle.message))
        assert seen == [(W.WORKER_STATE_STARTING, "waiting for a ready runner (r1)"),
                        (W.WORKER_STATE_STARTING, "no model loaded; call Init"),
                        (W.WORKER_STATE_LOADING, "loading model tiny"),
                        (W.WORKER_STATE_READY, "")]
        assert lifecycle.model is not None and lifecycle.model.source == "tiny" and lifecycle.weights_version == "v1"
        assert await readiness(servicer) == serving and lifecycle.generation_blocker(auto_wake=False) is None

        runner.on_reply(runner_info(asleep=True))
        await lifecycle.publish()
        assert lifecycle.state == W.WORKER_STATE_SLEEPING and lifecycle.sleep_level == 1
        assert lifecycle.sleeping_components == ["unet"] and await readiness(servicer) == not_serving
        assert lifecycle.generation_blocker(auto_wake=True) is None
        asleep = lifecycle.generation_blocker(auto_wake=False)
        assert asleep is not None and asleep.code.name == "FAILED_PRECONDITION"

        await lifecycle.load_failed("loading model x failed: no such directory")
        assert lifecycle.state == W.WORKER_STATE_FAILED and lifecycle.model is None
        assert lifecycle.weights_version == ""
        failed = lifecycle.generation_blocker(auto_wake=True)
        assert failed is not None and "no such directory" in failed.message

        # A runner that refused the desired state: FAILED with the failure, else waiting for a ready one.
        runner.apply_refused("no such directory")
        assert lifecycle.state == W.WORKER_STATE_FAILED
        await lifecycle.loaded()
        assert lifecycle.state == W.WORKER_STATE_STARTING and not lifecycle.runner_ready

        runner.on_watch(None)
        gone = lifecycle.generation_blocker(auto_wake=True)
        assert gone is not None and gone.code.name == "UNAVAILABLE"
        await lifecycle.start_draining()
        assert lifecycle.state == W.WORKER_STATE_DRAINING
        await pool.close()

    asyncio.run(walk())


# -- validation -----------------------------------------------------------------------------------

def test_validation_fills_defaults() -> None:
    limits = Limits()
    request = normalize(W.GenerateRequest(prompt="fox"), limits, ())
    assert (request.width, request.height, request.num_inference_steps) == (limits.default_size, limits.default_size,
                                                              limits.default_steps)
    assert request.guidance_scale == FALLBACK_GUIDANCE and request.num_images == 1
    assert len(request.request_id) == 32 and 0 <= request.seed < 2**64


def test_validation_names_every_bad_field_with_the_prefix() -> None:
    bad = W.GenerateRequest(width=7, height=4096, num_inference_steps=10_000, guidance_scale=float("nan"),
                            num_images=99, prompt="x" * 5000, request_id="has space", output_format=42)
    with pytest.raises(ValidationError) as caught:
        normalize(bad, Limits(), (), field_prefix="request.")
    fields = {name for name, _ in caught.value.violations}
    assert fields == {f"request.{name}" for name in ("width", "height", "num_inference_steps", "guidance_scale",
                                                     "num_images", "prompt", "request_id", "output_format")}


def test_validation_refuses_a_request_id_already_active() -> None:
    with pytest.raises(ValidationError) as caught:
        normalize(W.GenerateRequest(request_id="dup"), Limits(), {"dup"})
    assert caught.value.violations[0][0] == "request_id"


def model_info(**capabilities: object) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(pipeline_class="SomePipeline", min_size=128, size_multiple=128, max_size=256,
                                capabilities=common_pb2.ModelCapabilities(**capabilities))


def violated(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        normalize(request, Limits(), (), model=model)
    return dict(caught.value.violations)


def test_validation_follows_the_models_capabilities() -> None:
    flux = model_info(negative_prompt=False, guidance=common_pb2.GUIDANCE_KIND_DISTILLED, default_guidance_scale=3.5)
    request = normalize(W.GenerateRequest(prompt="fox"), Limits(), (), model=flux)
    # Unset fields: the pipeline's own default guidance, the default size rounded up onto the grid.
    assert (request.guidance_scale, request.width, request.height) == (3.5, 128, 128)
    refused = violated(W.GenerateRequest(negative_prompt="blur", width=192, height=384), flux)
    assert set(refused) == {"negative_prompt", "width", "height"}
    assert "takes no negative prompt" in refused["negative_prompt"] and "to 256" in refused["height"]
    unguided = model_info(negative_prompt=True, guidance=common_pb2.GUIDANCE_KIND_NONE)
    assert normalize(W.GenerateRequest(), Limits(), (), model=unguided).guidance_scale == 0
    assert set(violated(W.GenerateRequest(guidance_scale=2), unguided)) == {"guidance_scale"}
    # A runner that predates capabilities: the worker's defaults, nothing refused for them.
    legacy = common_pb2.ModelInfo(min_size=24, size_multiple=8)
    assert normalize(W.GenerateRequest(negative_prompt="blur"), Limits(), (), model=legacy).guidance_scale == 7.5


def test_image_seeds_wrap_at_two_to_the_64() -> None:
    assert image_seed(2**64 - 1, 0) == 2**64 - 1 and image_seed(2**64 - 1, 2) == 1


def test_a_request_costs_what_was_measured_between_sizes_and_grows_quadratically_beyond() -> None:
    from serving_common.cost import CostPoint, image_ms, request_seconds

    points = [CostPoint(64 * 64, step_ms=40.0, decode_ms=30.0), CostPoint(256 * 256, step_ms=2000.0, decode_ms=4000.0)]
    assert image_ms([], 64 * 64) is None
    assert image_ms(points, 32 * 32) == (40.0, 30.0)  # below the smallest: its cost (the overhead)
    step, decode = image_ms(points, 160 * 160) or (0, 0)
    assert 40 < step < 2000 and 30 < decode < 4000
    beyond, _ = image_ms(points, 512 * 512) or (0, 0)
    assert 2000 * 15 < beyond < 2000 * 16  # a + b x pixels^2 through both: about 16x for 4x the pixels
    alone = image_ms([CostPoint(256 * 256, 2000.0, 0.0)], 512 * 512)
    assert alone == (2000.0 * 16, 0.0)  # one point: quadratic from it, nothing measured decodes
    flat = image_ms([CostPoint(64 * 64, 50.0, 1.0), CostPoint(128 * 128, 50.0, 1.0)], 1024 * 1024)
    assert flat is not None and flat[0] == 50.0 * 64 ** 2  # no growth measured: quadratic, never flat
    assert request_seconds(points, 256 * 256, steps=10, images=2) == 2 * (10 * 2000 + 4000) / 1000


def test_a_request_that_cannot_finish_before_its_deadline_is_refused_naming_what_to_change() -> None:
    from worker_service.scheduling.estimate import too_long

    model = common_pb2.ModelInfo(costs=[common_pb2.CostPoint(pixels=64 * 64, step_ms=100.0, decode_ms=100.0)])
    request = normalize(worker_pb2.GenerateRequest(prompt="a", width=64, height=64, num_inference_steps=50), Limits(),
                        set())
    assert too_long(request, model, time_left=None) is None  # no deadline: nothing to miss
    assert too_long(request, model, time_left=6.0) is None  # 50 x 0.1 + 0.1 = 5.1 s
    # Within ESTIMATE_MARGIN (2) of the time left: the costs may have been measured under other load.
    assert too_long(request, model, time_left=3.0) is None
    fewer_steps = too_long(request, model, time_left=1.0)
    assert fewer_steps is not None and [field for field, _ in fewer_steps.violations] == ["num_inference_steps"]
    smaller = too_long(request, model, time_left=0.05)  # not even one step and a decode (0.2 s) fits twice
    assert smaller is not None and smaller.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [(field, "5.1 s" in why) for field, why in smaller.violations] == [("width", True)]
    assert too_long(request, common_pb2.ModelInfo(), time_left=0.1) is None  # nothing measured: not refused
