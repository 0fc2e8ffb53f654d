"""The runner's core: one model on one device, and every operation that touches them.

``ModelHost`` is what vLLM splits between its ``Worker`` (owns the device, loads the model,
sleeps and wakes it, updates its weights) and its ``ModelRunner`` (runs the model's forward
passes for the scheduled batch): here the device, the model and the operations on them have one
owner, and the step engine (``step_engine.py``) is the scheduler and model runner of
step-batched executions. ``service.py`` is the gRPC face: it only translates protos to these
calls and back.

Exclusive access has one owner, the ``DeviceGate`` (``device_gate.py``): the engine's loop holds
the device between exclusive users, and everything else here holds it alone (``run_alone``; a
request-level execution through ``exclusive``), so LoadWeights, Sleep and LoadModel always fall
between steps and between executions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.acceleration.apply import check, platform_offer
from runner_service.adapter_stores import AdapterSource, RegisteredAdapter
from runner_service.adapters import AdapterSet
from runner_service.config import RunnerConfig
from runner_service.controlnets import ControlNets
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.device_gate import CallWatch, DeviceGate
from runner_service.execution import (
    BatchResult,
    StepCallback,
    StepProgress,
    StopFlag,
    run_checked,
    stream_batch,
    task_name,
    validate_batch,
)
from runner_service.group import GroupCommands, GroupMember, GroupOperationError
from runner_service.group.operations import RankDevice, group_operations
from runner_service.loaded_model import LoadedModel
from runner_service.model_extras import LoadOptions
from runner_service.model_roots import ModelRoots
from runner_service.model_slot import ModelSlot
from runner_service.model_sources import HubCache, download_pipeline
from runner_service.operations import (
    DeviceOperation,
    LoadAdapter,
    LoadWeights,
    PushWeights,
    Sleep,
    UnloadAdapter,
    WakeUp,
)
from runner_service.overrun import Abandonment
from runner_service.parallel import ParallelPlan, refusal, world_violations
from runner_service.pipeline_adapter import short_reason
from runner_service.platforms import Platform
from runner_service.progress_pacing import ProgressPacing
from runner_service.sleep import SleepReport
from runner_service.step_engine import StepEngine
from runner_service.weights import WeightsLoaded, read_tensors, weights_checksum
from serving_common.errors import ServiceError, invalid_argument
from serving_common.input_rules import AccelerationPlan

logger = logging.getLogger(__name__)

# The adapter kinds a runner group refuses, and why.
NOT_ON_A_GROUP: dict[int, str] = {common_pb2.ADAPTER_KIND_CONTROLNET: "a runner group takes no ControlNets yet"}
# LoadWeights reads at most this much by default, or twice the model's parameters if more.
MIN_WEIGHTS_BYTES = 64 * 1024 * 1024
# The smallest side a model's costs are measured at when it loads (then twice it).
PROBE_SIDE = 64

T = TypeVar("T")


class ModelHost:
    """Hosts one model on one platform: the device gate, the model slot and the step engine, and
    the operations of the RunnerService (load, execute, sleep and wake, weights, adapters)."""

    def __init__(self, platform: Platform, config: RunnerConfig, member: GroupMember | None = None) -> None:
        self.platform = platform
        # A runner group's rank (``--devices``): every rank has its own host, rank 0's serves and
        # runs each device operation on all of them (``group/operations.py``); None: one device.
        self.member = member
        self._group = GroupCommands(member, group_operations(self)) if member is not None else None
        self._devices: list[RankDevice] = []
        self.roots = ModelRoots(list(config.model_root))
        self.limits = config.batch_limits(platform.default_max_size)
        self.max_weights_bytes = config.max_weights_bytes
        self.max_adapters = config.max_adapters
        self.max_controlnet_bytes = config.max_controlnet_bytes
        # The largest message Execute sends: a video's frames go in ExecuteFrames within it.
        self.max_message_bytes = config.max_message_bytes
        # --batching step: the tasks of a model's step-level loop join a running batch.
        self.step_batching = config.step_batching
        self.step_schedule = config.step_schedule  # reported in RunnerInfo: the worker schedules by it
        self.instance_id = uuid.uuid4().hex
        self.gate = DeviceGate(config.overrun_exit_after)
        self.slot = ModelSlot(platform, config.model_cache, self.roots, self._adapter_set,
                              HubCache(download=download_pipeline if config.allow_download else None),
                              config.single_file_config, self._controlnets)
        self.engine = StepEngine(self.gate, self.slot.require, self.limits, PromptCache(config.prompt_cache_bytes),
                                 SizeTurns() if self.step_schedule == "budget" else None, platform.time_point,
                                 platform.to_host)

    @property
    def model(self) -> LoadedModel | None:
        return self.slot.model

    @property
    def rank(self) -> int:
        return self.member.rank if self.member is not None else 0

    def group_member(self) -> GroupMember:
        """This rank's place in its group (a group's operations only)."""
        assert self.member is not None
        return self.member

    @property
    def world_size(self) -> int:
        return self.member.world_size if self.member is not None else 1

    def follow(self) -> None:
        """A follower rank's whole life: runs rank 0's operations until it stops the group."""
        assert self._group is not None and self.rank != 0
        self._group.follow()

    def stop_group(self) -> None:
        """Rank 0, after serving: the followers leave."""
        if self._group is not None:
            self._group.stop()

    def devices(self) -> list[RankDevice]:
        """Every device by rank: this one's now, a group's others as of its last operation."""
        own = RankDevice(0, self.platform.device_name(), self.platform.memory())
        return [own, *self._devices[1:]]

    async def describe_devices(self) -> None:
        """Reads every rank's device and memory (GetInfo lists them; refreshed after each operation)."""
        if self._group is not None:
            await self.gate.run_alone(CallWatch("GetInfo"), self._describe)

    def _describe(self) -> None:
        assert self._group is not None
        self._devices = self._group.run("describe")

    def _on_group(self, name: str, arguments: Any, local: Any) -> Any:
        """Runs a group operation from rank 0's device thread: rank 0's result, or the error the
        caller gets (rank 0's own where it failed too, with its status code)."""
        assert self._group is not None
        try:
            return self._group.run(name, arguments, local)[0]
        except GroupOperationError as error:
            own = error.own
            if own is None:
                raise ServiceError(grpc.StatusCode.INTERNAL, str(error)) from error
            own_reason = error.failures.get(0)
            if isinstance(own, ServiceError) and any(reason != own_reason for reason in error.failures.values()):
                # rank 0 failed for another rank's reason (a load that failed there): say which
                raise ServiceError(own.code, f"{own.message}; {error}", own.violations) from error
            raise own from error

    async def _everywhere(self, watch: CallWatch, operation: DeviceOperation[T]) -> T:
        """A device operation with the device held alone: on this device, or on every rank of a group
        (each runs the same operation on its own host)."""
        if self._group is None:
            return await self.gate.run_alone(watch, lambda: operation.run(self, watch.before_change))
        result: T = await self._on_every_rank(watch, "replicated", operation)
        return result

    async def _on_every_rank(self, watch: CallWatch, name: str, arguments: Any, payload: Any = None) -> Any:
        """Group operation ``name`` on every rank with the device held alone, then the devices read
        again. ``payload``: what rank 0 hands its own operation beside its caller's ``before_change``
        (never broadcast with the arguments)."""
        local = watch.before_change if payload is None else (watch.before_change, payload)

        def work() -> Any:
            result = self._on_group(name, arguments, local)
            self._describe()
            return result

        return await self.gate.run_alone(watch, work)

    def _adapter_set(self) -> AdapterSet:
        """A new model's adapters: none yet, their files read like LoadWeights' (roots, size cap)."""
        def read(path: Path) -> tuple[dict[str, torch.Tensor], str]:
            return read_tensors(path, self.roots, self.max_weights_bytes or MIN_WEIGHTS_BYTES)

        return AdapterSet(self.max_adapters, read)

    def _controlnets(self) -> ControlNets:
        """A new model's ControlNets: none yet, their weights read like LoadWeights' (roots), up to
        ``--max-controlnet-bytes``."""
        def read(path: Path) -> tuple[dict[str, torch.Tensor], str]:
            return read_tensors(path, self.roots, self.max_controlnet_bytes)

        return ControlNets(self.max_controlnet_bytes, self.roots, read)

    def weights_budget(self) -> int:
        """Bytes one LoadWeights or PushWeights may bring: ``--max-weights-bytes``, or twice the
        loaded model's parameters and at least ``MIN_WEIGHTS_BYTES``."""
        return self.max_weights_bytes or max(2 * self.slot.require().parameter_bytes, MIN_WEIGHTS_BYTES)

    def step_batched_tasks(self, model: LoadedModel | None) -> tuple[str, ...]:
        """The tasks whose requests join the step batch: those the model's loop runs, of the tasks
        it serves; none without step-level batching, and none on a runner group, whose ranks run
        each request as one pipeline call (the step loop calls the denoiser with rows of several
        requests, which the parallel modes are not verified on)."""
        if not self.step_batching or self._group is not None or model is None or model.loop is None:
            return ()
        return tuple(task for task in model.capabilities.tasks if task in model.loop.tasks)

    async def load(self, source: str, dtype_name: str | None, watch: CallWatch | None = None,
                   plan: AccelerationPlan | None = None, parallel: ParallelPlan | None = None,
                   options: LoadOptions | None = None) -> None:
        """Loads a model in place of the one loaded before, which stays loaded and serving if this
        fails; no dtype: the platform's default; no plan: plain diffusers; no parallel plan: each
        request on one device; ``options``: its component overrides and adapters to fuse. A plan the
        platform or the group cannot take is refused before anything else."""
        watch = watch or CallWatch("LoadModel")
        plan = plan or AccelerationPlan()
        parallel = parallel or ParallelPlan()
        check(plan, platform_offer(self.platform), "this runner")
        violations = world_violations(parallel, self.world_size)
        if violations:
            raise refusal(violations)
        if self._group is not None:
            _check_group_acceleration(plan)
        options = options or LoadOptions()
        checked = await asyncio.to_thread(self.slot.check, source, options)  # a built-in is built once, here
        if self._group is not None:  # a group measures as it serves: its calls run on every rank
            await self._on_every_rank(watch, "load", (source, dtype_name, plan, parallel, options))
            return
        await self.gate.run_alone(watch, lambda: self.slot.replace(checked, dtype_name, plan, watch))
        await self.gate.run_alone(watch, lambda: self._measure_costs(watch))

    def _measure_costs(self, watch: CallWatch) -> None:
        """Two short calls of the new model (two steps, at the smallest size from 64 up and at twice
        that side) so that its costs are known before its first request (``cost_meter.py``); each
        only while the LoadModel's caller still waits (else the model is measured as it serves)."""
        model = self.slot.require()
        capabilities = model.capabilities
        task = next((task for task in ("TEXT_TO_IMAGE", "TEXT_TO_VIDEO") if task in capabilities.tasks), None)
        if task is None:
            return  # an edit model: measured as it serves
        multiple = capabilities.size_multiple or 8
        side = max(capabilities.min_size, -(-PROBE_SIDE // multiple) * multiple)
        largest = self.largest_side(model)
        frames = capabilities.video.min_frames if capabilities.video is not None else 0
        for size in (side, 2 * side):
            if size > largest or not watch.waiting:
                break
            item = runner_pb2.ExecuteItem(request_id="cost-probe", prompt="a", width=size, height=size,
                                          num_inference_steps=2, guidance_scale=capabilities.default_guidance,
                                          num_images=1, task=f"TASK_{task}",
                                          num_frames=frames)
            try:
                run_checked(model, [item], self.limits, lambda _: None, Abandonment(),
                            to_host=self.platform.to_host)
            except Exception as error:  # noqa: BLE001 - serves all the same, measured as it does
                logger.warning("could not measure %s at %dx%d: %s", model.source, size, size, short_reason(error))
                return

    def largest_side(self, model: LoadedModel) -> int:
        """The largest width or height ``model`` generates here: its own limit within ``--max-size``."""
        return min(model.capabilities.max_size or self.limits.max_size, self.limits.max_size)

    def check_batch(self, items: list[runner_pb2.ExecuteItem]) -> None:
        """Checks a batch against the limits and the model in place (again under the gate, on the
        model then)."""
        validate_batch(items, self.limits, self.model)

    async def execute(self, items: list[runner_pb2.ExecuteItem], progress: bool,
                      progress_interval_ms: int = 0) -> AsyncGenerator[StepProgress | BatchResult, None]:
        """Yields the batch's progress (when asked, paced as ``progress_pacing`` says), then its result.
        A task the step-batched model's loop runs (text-to-image; image-to-image and inpainting where
        the family has them) joins the running batch; anything else has the device alone once the step
        batch has drained."""
        async with contextlib.AsyncExitStack() as stack:
            model = self.model
            if task_name(items[0]) in self.step_batched_tasks(model):
                events = self.engine.execute(items, ProgressPacing.of(progress, progress_interval_ms))
            else:
                await stack.enter_async_context(self.gate.exclusive())
                events = stream_batch(items, self._run_batch, ProgressPacing.of(progress, progress_interval_ms),
                                      self.gate.thread)
            await stack.enter_async_context(aclosing(events))
            async for event in events:
                yield event

    def _run_batch(self, items: list[runner_pb2.ExecuteItem], on_step: StepCallback,
                   cancelled: Abandonment) -> BatchResult:
        """A request-level batch on the device thread: on this device, or on every rank of a group;
        one unit of device work, serving its caller (``overrun.py``)."""
        with self.gate.work.working([cancelled]):
            if self._group is None:
                return self.run_here(items, on_step, cancelled)
            outputs: BatchResult = self._on_group("execute", items, (on_step, cancelled))
            return outputs

    def run_here(self, items: list[runner_pb2.ExecuteItem], on_step: StepCallback,
                 cancelled: StopFlag) -> BatchResult:
        return run_checked(self.slot.require(), items, self.limits, on_step, cancelled, self.platform.time_point,
                           self.platform.to_host)

    async def sleep(self, level: int, tags: list[str], watch: CallWatch) -> SleepReport:
        return await self._everywhere(watch, Sleep(level, tuple(tags)))

    async def wake(self, tags: list[str], watch: CallWatch) -> int:
        """Wakes the tagged components (all when none); returns the weight bytes restored."""
        return await self._everywhere(watch, WakeUp(tuple(tags)))

    async def load_weights(self, path: str, expected_digest: str, watch: CallWatch) -> WeightsLoaded:
        """Copies a safetensors file's (or directory's) tensors into the model, all or nothing."""
        return await self._everywhere(watch, LoadWeights(self.roots.check(path, "path"), expected_digest))

    async def apply_push(self, tensors: dict[str, torch.Tensor], digest: str,
                         watch: CallWatch) -> tuple[WeightsLoaded, str]:
        """Applies a PushWeights stream's tensors, all or nothing; returns what was loaded and the
        weights' checksum after it. On a group the tensors are sent to every rank one by one."""
        if self._group is None:
            return await self._everywhere(watch, PushWeights(tensors, digest))
        listing = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
        pushed: tuple[WeightsLoaded, str] = await self._on_every_rank(watch, "push", (listing, digest), tensors)
        return pushed

    async def checksum(self, watch: CallWatch) -> tuple[str, str]:
        """The weights' checksum and version."""
        def work() -> tuple[str, str]:
            model = self.slot.require()
            return weights_checksum(model), model.weights_version

        return await self.gate.run_alone(watch, work)

    async def load_adapter(self, kind: int, name: str, path: str, pin: bool, expected_digest: str,
                           watch: CallWatch) -> RegisteredAdapter:
        """Registers an adapter of ``kind`` (``operations.LoadAdapter``); a runner group takes no
        ControlNets: its ranks run each request as one pipeline call through parallel modes not
        verified with ControlNets."""
        if self._group is not None and kind in NOT_ON_A_GROUP:
            raise invalid_argument({"kind": NOT_ON_A_GROUP[kind]})
        source = AdapterSource(name, self.roots.check(path, "path"), pin, expected_digest)
        return await self._everywhere(watch, LoadAdapter(kind, source))

    async def unload_adapter(self, name: str, watch: CallWatch) -> None:
        await self._everywhere(watch, UnloadAdapter(name))


def _check_group_acceleration(plan: AccelerationPlan) -> None:
    """What a runner group cannot take of an acceleration plan, refused naming the field."""
    if plan.cache:
        raise invalid_argument({"acceleration.cache": (
            "not on a runner group: a step cache skips the denoiser where its first block's residual barely "
            "changed, which each rank would judge on its own share of the sequence, so ranks could take different "
            "branches and wait on each other")})
    if plan.compile:
        raise invalid_argument({"acceleration.compile": (
            "not on a runner group yet: compiling through the parallel modes' hooks is unverified")})
