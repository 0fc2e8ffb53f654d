"""Sleep and wake, following vLLM / vllm-omni.

Level 1 moves a component's weights to the platform's offload store and frees them on the
device; waking copies them back, so outputs are bit-identical, updates from LoadWeights
included. Level 2 keeps only the component's buffers (in host memory) and discards its
weights; waking reloads them from the model's source, which drops LoadWeights updates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from runner_service.acceleration.apply import denoiser_of, quantize
from runner_service.loaded_model import Component, LoadedModel, describe, own
from runner_service.platforms import MemoryUsage, Platform
from runner_service.tensor_parts import Layout, is_composite, join, split, stored_bytes
from serving_common.errors import ServiceError, invalid_argument

logger = logging.getLogger(__name__)

LEVELS = (1, 2)
# Sleep and WakeUp name components; a model has a handful.
MAX_TAGS = 64
MAX_TAG_CHARS = 128


def check_tags(tags: list[str]) -> None:
    """At most ``MAX_TAGS`` tags of at most ``MAX_TAG_CHARS`` characters (INVALID_ARGUMENT)."""
    if len(tags) > MAX_TAGS:
        raise invalid_argument({"tags": f"{len(tags)} tags; at most {MAX_TAGS}"})
    long = {f"tags[{index}]": f"{len(tag)} characters; at most {MAX_TAG_CHARS}"
            for index, tag in enumerate(tags) if len(tag) > MAX_TAG_CHARS}
    if long:
        raise invalid_argument(long)


@dataclass(frozen=True)
class SleepReport:
    freed_bytes: int
    weight_bytes_released: int
    before: MemoryUsage
    after: MemoryUsage


def _tensors(module: torch.nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = dict(module.named_parameters())
    if buffers:
        found.update(module.named_buffers())
    return found


def _release(tensors: dict[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _restore(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    targets = _tensors(module)
    for name, value in values.items():
        target = targets[name]
        if is_composite(target) and not is_composite(value):
            # A quantized parameter read back from the files: a plain parameter again (quantized
            # after, as at load), not a plain tensor inside the quantized one.
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, torch.nn.Parameter(value, requires_grad=False))
        else:
            target.data = value


def _nothing() -> None:
    pass


class SleepController:
    """Puts components of the loaded model to sleep and wakes them, measuring what it frees.

    Both are all or nothing: every selected component is copied out (or read back) before the
    first one changes, so a failure part way, or a caller gone by then (``before_change``
    raises), leaves the model exactly as it was.
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        # Level-2 sleepers' buffers, kept in host memory until wake-up.
        self._saved_buffers: dict[str, dict[str, torch.Tensor]] = {}
        # Each level-1 component's quantized tensors, stored as their parts: how to rebuild them.
        self._layouts: dict[str, dict[str, Layout]] = {}

    def _settle(self) -> MemoryUsage:
        # No gc.collect(): released tensors are freed by reference counting, and a full
        # collection of a loaded pipeline's object graph costs ~150 ms, more than the copies.
        self.platform.synchronize()
        self.platform.empty_cache()
        self.platform.release_host_memory()
        return self.platform.memory()

    def sleep(self, model: LoadedModel, level: int, tags: list[str],
              before_change: Callable[[], None] = _nothing) -> SleepReport:
        if level not in LEVELS:
            raise invalid_argument({"level": f"{level} is not a sleep level; use 1 or 2"})
        targets = [c for c in model.select(tags) if not c.asleep]
        before = self._settle()
        buffers: dict[str, dict[str, torch.Tensor]] = {}
        if level == 1:
            self._offload(targets)
        else:
            buffers = {c.name: {name: buffer.detach().to("cpu", copy=True) for name, buffer in
                                c.module.named_buffers()} for c in targets}
        try:
            before_change()
        except BaseException:
            self._discard(targets if level == 1 else [])
            raise
        released = 0
        for component in targets:
            if level == 2:
                self._saved_buffers[component.name] = buffers.pop(component.name)
                model.weight_updates = [u for u in model.weight_updates if component.name not in u.components]
            tensors = _tensors(component.module)
            released += sum(stored_bytes(t) for t in tensors.values())
            _release(tensors)
            component.sleep_level = level
        after = self._settle()
        freed = before.used_bytes - after.used_bytes
        logger.info("sleep level %d of %s: released %d weight bytes, freed %d bytes",
                    level, [c.name for c in targets] or "nothing (already asleep)", released, freed)
        if freed < -self.platform.memory_noise_bytes:
            raise ServiceError(
                grpc.StatusCode.INTERNAL,
                f"memory usage increased after sleeping: {before.used_bytes} bytes before, "
                f"{after.used_bytes} after; the components are asleep regardless",
            )
        return SleepReport(freed, released, before, after)

    def _offload(self, targets: list[Component]) -> None:
        """Copies every target's tensors to the offload store; on a failure, drops the copies made."""
        store = self.platform.offload_store()
        for component in targets:
            try:
                plain, self._layouts[component.name] = split({k: v.data for k, v in _tensors(component.module).items()})
                store.put(component.name, plain)
            except Exception as error:  # noqa: BLE001 - a full disk, a bad spill directory, no host memory
                self._discard(targets)
                logger.error("sleep level 1 failed offloading %s: %s; nothing was put to sleep",
                             component.name, describe(error))
                raise ServiceError(
                    grpc.StatusCode.INTERNAL,
                    f"sleep failed offloading {component.name} ({describe(error)}); nothing was put to sleep",
                ) from error

    def _discard(self, components: list[Component]) -> None:
        store = self.platform.offload_store()
        for component in components:
            store.discard(component.name)
            self._layouts.pop(component.name, None)

    def _wake_values(self, model: LoadedModel, component: Component) -> dict[str, torch.Tensor]:
        if component.sleep_level == 1:
            return join(self.platform.offload_store().get(component.name, model.device),
                        self._layouts.get(component.name, {}))
        values = model.reload_parameters(component.name)
        values.update(
            (name, own(buffer.to(model.device, copy=True)))
            for name, buffer in self._saved_buffers[component.name].items()
        )
        return values

    def wake(self, model: LoadedModel, tags: list[str], before_change: Callable[[], None] = _nothing) -> int:
        """Wakes the tagged components (all when empty); returns the weight bytes restored."""
        targets = [c for c in model.select(tags) if c.asleep]
        values: dict[str, dict[str, torch.Tensor]] = {}
        for component in targets:
            try:
                values[component.name] = self._wake_values(model, component)
            except Exception as error:  # noqa: BLE001 - reported with what is still asleep
                values.clear()
                self._settle()
                # The model's files gone or changed: a precondition; anything else is the runner's.
                code = grpc.StatusCode.INTERNAL
                if isinstance(error, ServiceError):
                    denied = error.code == grpc.StatusCode.PERMISSION_DENIED
                    code = error.code if denied else grpc.StatusCode.FAILED_PRECONDITION
                asleep = ", ".join(model.asleep_components())
                logger.error("wake-up failed restoring %s: %s; still asleep: %s", component.name,
                             describe(error), asleep)
                raise ServiceError(code, f"wake-up failed restoring {component.name} ({describe(error)}); "
                                         f"nothing was woken; still asleep: {asleep}") from error
        before_change()
        restored = 0
        store = self.platform.offload_store()
        for component in targets:
            restoring = values.pop(component.name)
            _restore(component.module, restoring)
            restored += sum(stored_bytes(v) for v in restoring.values())
            if component.sleep_level == 1:
                store.discard(component.name)
                self._layouts.pop(component.name, None)
            else:
                self._saved_buffers.pop(component.name, None)
                # Read back from the model's files as stored: its fused adapters fused again, and
                # quantized again, as it was loaded (no adapter is resident: a level-2 sleep evicted them).
                model.extras.fuse_adapters(model.pipeline, [component.name])
                if model.acceleration.quantization and component.module is denoiser_of(model.pipeline):
                    quantize(component.module, model.acceleration.quantization)
            component.sleep_level = 0
        self.platform.synchronize()
        self._settle()
        return restored

    def forget(self, model: LoadedModel) -> None:
        """Drops whatever is held for a model that is being replaced."""
        for component in model.components.values():
            if component.sleep_level == 1:
                self.platform.offload_store().discard(component.name)
        self._saved_buffers.clear()
        self._layouts.clear()
