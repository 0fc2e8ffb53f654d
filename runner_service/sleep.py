"""Sleep and wake, following vLLM / vllm-omni.

Level 1 moves a component's weights to the platform's offload store and frees them on the
device; waking copies them back, so outputs are bit-identical, updates from LoadWeights
included. Level 2 keeps only the component's buffers (in host memory) and discards its
weights; waking reloads them from the model's source, which drops LoadWeights updates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import torch

from runner_service.loaded_model import Component, LoadedModel, own
from runner_service.platforms import MemoryUsage, Platform
from serving_common.errors import ServiceError, invalid_argument

logger = logging.getLogger(__name__)

LEVELS = (1, 2)


@dataclass(frozen=True)
class SleepReport:
    freed_bytes: int
    weight_bytes_released: int
    before: MemoryUsage
    after: MemoryUsage


def _tensors(module: torch.nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    found = {name: p for name, p in module.named_parameters()}
    if buffers:
        found.update(module.named_buffers())
    return found


def _release(tensors: dict[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _restore(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    targets = _tensors(module)
    for name, value in values.items():
        targets[name].data = value


class SleepController:
    """Puts components of the loaded model to sleep and wakes them, measuring what it frees."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        # Level-2 sleepers' buffers, kept in host memory until wake-up.
        self._saved_buffers: dict[str, dict[str, torch.Tensor]] = {}

    def _settle(self) -> MemoryUsage:
        # No gc.collect(): released tensors are freed by reference counting, and a full
        # collection of a loaded pipeline's object graph costs ~150 ms, more than the copies.
        self.platform.synchronize()
        self.platform.empty_cache()
        self.platform.release_host_memory()
        return self.platform.memory()

    def sleep(self, model: LoadedModel, level: int, tags: list[str]) -> SleepReport:
        if level not in LEVELS:
            raise invalid_argument({"level": f"{level} is not a sleep level; use 1 or 2"})
        targets = [c for c in model.select(tags) if not c.asleep]
        before = self._settle()
        released = 0
        for component in targets:
            released += self._sleep_component(model, component, level)
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

    def _sleep_component(self, model: LoadedModel, component: Component, level: int) -> int:
        module = component.module
        if level == 1:
            tensors = _tensors(module)
            self.platform.offload_store().put(component.name, {k: v.data for k, v in tensors.items()})
        else:
            self._saved_buffers[component.name] = {
                name: buffer.detach().to("cpu", copy=True) for name, buffer in module.named_buffers()
            }
            tensors = _tensors(module)
            model.weight_updates = [u for u in model.weight_updates if component.name not in u.components]
        released = sum(t.numel() * t.element_size() for t in tensors.values())
        _release(tensors)
        component.sleep_level = level
        return released

    def wake(self, model: LoadedModel, tags: list[str]) -> int:
        """Wakes the tagged components (all when empty); returns the weight bytes restored."""
        restored = 0
        for component in model.select(tags):
            if not component.asleep:
                continue
            if component.sleep_level == 1:
                values = self.platform.offload_store().take(component.name, model.device)
            else:
                values = model.reload_parameters(component.name)
                values.update(
                    (name, own(buffer.to(model.device, copy=True)))
                    for name, buffer in self._saved_buffers.pop(component.name).items()
                )
            _restore(component.module, values)
            restored += sum(v.numel() * v.element_size() for v in values.values())
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
