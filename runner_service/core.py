"""The runner's core: one model on one device, and every operation that touches them.

``ModelHost`` is what vLLM splits between its ``Worker`` (owns the device, loads the model,
sleeps and wakes it, updates its weights) and its ``ModelRunner`` (runs the model's forward
passes for the scheduled batch): here the device, the model and the operations on them have one
owner, and the step engine (``denoising/engine.py``) is the scheduler and model runner of
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
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

import torch

from diffusion.v1 import runner_pb2
from runner_service.acceleration.apply import check, platform_offer
from runner_service.acceleration.plan import AccelerationPlan
from runner_service.adapters import Adapter, AdapterSet
from runner_service.config import RunnerConfig
from runner_service.denoising.engine import StepEngine
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.device_gate import CallWatch, DeviceGate
from runner_service.execution import BatchResult, StepProgress, stream_batch, task_name, validate_batch
from runner_service.loaded_model import LoadedModel
from runner_service.model_roots import ModelRoots
from runner_service.model_slot import ModelSlot
from runner_service.platforms import Platform
from runner_service.sleep import SleepReport
from runner_service.weights import WeightsLoaded, apply_tensors, load_weights, read_tensors, weights_checksum
from serving_common.errors import failed_precondition

# LoadWeights reads at most this much by default, or twice the model's parameters if more.
MIN_WEIGHTS_BYTES = 64 * 1024 * 1024


class ModelHost:
    """Hosts one model on one platform: the device gate, the model slot and the step engine, and
    the operations of the RunnerService (load, execute, sleep and wake, weights, adapters)."""

    def __init__(self, platform: Platform, config: RunnerConfig) -> None:
        self.platform = platform
        self.roots = ModelRoots(list(config.model_root))
        self.limits = config.batch_limits
        self.max_weights_bytes = config.max_weights_bytes
        self.max_adapters = config.max_adapters
        # The largest message Execute sends: a video's frames go in ExecuteFrames within it.
        self.max_message_bytes = config.max_message_bytes
        # --batching step: the tasks of a model's step-level loop join a running batch.
        self.step_batching = config.step_batching
        self.instance_id = uuid.uuid4().hex
        self.gate = DeviceGate()
        self.slot = ModelSlot(platform, config.model_cache, self.roots, self._adapter_set)
        self.engine = StepEngine(self.gate, self.slot.require, self.limits, PromptCache(config.prompt_cache_bytes),
                                 SizeTurns() if config.step_schedule == "budget" else None)

    @property
    def model(self) -> LoadedModel | None:
        return self.slot.model

    def _adapter_set(self) -> AdapterSet:
        """A new model's adapters: none yet, their files read like LoadWeights' (roots, size cap)."""
        def read(path: Path) -> tuple[dict[str, torch.Tensor], str]:
            return read_tensors(path, self.roots, self.max_weights_bytes or MIN_WEIGHTS_BYTES)

        return AdapterSet(self.max_adapters, read)

    def weights_budget(self) -> int:
        """Bytes one LoadWeights or PushWeights may bring: ``--max-weights-bytes``, or twice the
        loaded model's parameters and at least ``MIN_WEIGHTS_BYTES``."""
        return self.max_weights_bytes or max(2 * self.slot.require().parameter_bytes, MIN_WEIGHTS_BYTES)

    def step_batched_tasks(self, model: LoadedModel | None) -> tuple[str, ...]:
        """The tasks whose requests join the step batch: those the model's loop runs, of the tasks
        it serves; none without step-level batching."""
        if not self.step_batching or model is None or model.loop is None:
            return ()
        return tuple(task for task in model.capabilities.tasks if task in model.loop.tasks)

    async def load(self, source: str, dtype_name: str | None, watch: CallWatch | None = None,
                   plan: AccelerationPlan | None = None) -> None:
        """Loads a model in place of the one loaded before, which stays loaded and serving if this
        fails; no dtype: the platform's default; no plan: plain diffusers. A plan the platform
        cannot take is refused before anything else."""
        watch = watch or CallWatch("LoadModel")
        plan = plan or AccelerationPlan()
        check(plan, platform_offer(self.platform), "this runner")
        checked = await asyncio.to_thread(self.slot.check, source)
        await self.gate.run_alone(watch, lambda: self.slot.replace(checked, dtype_name, plan, watch))

    def check_batch(self, items: list[runner_pb2.ExecuteItem]) -> None:
        """Checks a batch against the limits and the model in place (again under the gate, on the
        model then)."""
        validate_batch(items, self.limits, self.model)

    async def execute(self, items: list[runner_pb2.ExecuteItem],
                      progress: bool) -> AsyncGenerator[StepProgress | BatchResult, None]:
        """Yields the batch's progress (when asked), then its result. A task the step-batched
        model's loop runs (text-to-image; image-to-image and inpainting where the family has them)
        joins the running batch; anything else has the device alone once the step batch has drained."""
        async with contextlib.AsyncExitStack() as stack:
            model = self.model
            if task_name(items[0]) in self.step_batched_tasks(model):
                events = self.engine.execute(items, progress)
            else:
                await stack.enter_async_context(self.gate.exclusive())
                events = stream_batch(items, self.slot.require, progress, self.limits, self.gate.thread)
            await stack.enter_async_context(aclosing(events))
            async for event in events:
                yield event

    async def sleep(self, level: int, tags: list[str], watch: CallWatch) -> SleepReport:
        def work() -> SleepReport:
            model = self.slot.require()
            if level == 2 and model.adapters.resident():
                # Level 2 reloads weights by their checkpoint names: take peft's wrappers off first.
                if model.asleep_components():
                    raise failed_precondition("wake the model before a level-2 sleep while adapters are resident")
                watch.before_change()
                model.adapters.evict_all(model.pipeline)
            return self.slot.sleeper.sleep(model, level, tags, watch.before_change)

        return await self.gate.run_alone(watch, work)

    async def wake(self, tags: list[str], watch: CallWatch) -> int:
        """Wakes the tagged components (all when none); returns the weight bytes restored."""
        def work() -> int:
            model = self.slot.require()
            model.forget_cached_rows()
            return self.slot.sleeper.wake(model, tags, watch.before_change)

        return await self.gate.run_alone(watch, work)

    async def load_weights(self, path: str, expected_digest: str, watch: CallWatch) -> WeightsLoaded:
        """Copies a safetensors file's (or directory's) tensors into the model, all or nothing."""
        checked = self.roots.check(path, "path")

        def work() -> WeightsLoaded:
            model = self.slot.require()
            model.forget_cached_rows()
            return load_weights(model, checked, self.roots, self.weights_budget(), expected_digest,
                                watch.before_change)

        return await self.gate.run_alone(watch, work)

    async def apply_push(self, tensors: dict[str, torch.Tensor], digest: str,
                         watch: CallWatch) -> tuple[WeightsLoaded, str]:
        """Applies a PushWeights stream's tensors, all or nothing; returns what was loaded and the
        weights' checksum after it."""
        def work() -> tuple[WeightsLoaded, str]:
            model = self.slot.require()
            model.forget_cached_rows()
            loaded = apply_tensors(model, tensors, digest, watch.before_change, pushed=True)
            return loaded, weights_checksum(model)

        return await self.gate.run_alone(watch, work)

    async def checksum(self, watch: CallWatch) -> tuple[str, str]:
        """The weights' checksum and version."""
        def work() -> tuple[str, str]:
            model = self.slot.require()
            return weights_checksum(model), model.weights_version

        return await self.gate.run_alone(watch, work)

    async def load_adapter(self, name: str, path: str, pin: bool, expected_digest: str,
                           watch: CallWatch) -> Adapter:
        checked = self.roots.check(path, "path")

        def work() -> Adapter:
            model = self.slot.require()
            model.require_awake()
            return model.adapters.register(model.pipeline, name, checked, pin, expected_digest, watch.before_change)

        return await self.gate.run_alone(watch, work)

    async def unload_adapter(self, name: str, watch: CallWatch) -> None:
        def work() -> None:
            model = self.slot.require()
            watch.before_change()
            model.adapters.unregister(model.pipeline, name)

        await self.gate.run_alone(watch, work)
