"""Accelerators reached through a torch device module (``torch.cuda``, ``torch.npu``).

CUDA and Ascend NPU expose the same device-module API, so one class serves both; each
subclass only names its device type and its module.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from runner_service.platforms.base import MemoryUsage, Platform, TimePoint
from runner_service.platforms.offload import OffloadStore, PinnedHostStore


@dataclass(frozen=True)
class DevicePoint:
    """A timing event recorded on the device's current stream."""

    event: Any  # torch.cuda.Event / torch.npu.Event, enable_timing=True

    def ms_since(self, earlier: TimePoint) -> float:
        if not isinstance(earlier, DevicePoint):
            raise TypeError(f"a device point cannot be compared with {type(earlier).__name__}")
        self.event.synchronize()
        elapsed: float = earlier.event.elapsed_time(self.event)
        return elapsed


class AcceleratorPlatform(Platform):
    """One accelerator device; ``name`` is both the platform's name and torch's device type."""

    def __init__(self, index: int = 0) -> None:
        device_module = self.device_module()
        if not device_module.is_available():
            raise RuntimeError(f"{self.name.upper()} was requested but torch.{self.name}.is_available() is False")
        count = device_module.device_count()
        if index >= count:
            raise RuntimeError(f"{self.name}:{index} requested but only {count} devices exist")
        super().__init__(torch.device(self.name, index))
        self._module = device_module
        device_module.set_device(self.device)
        self._store = PinnedHostStore(self.synchronize)

    @classmethod
    def on_device(cls, index: int, spill_dir: Path | None) -> AcceleratorPlatform:
        return cls(index)

    @classmethod
    @abstractmethod
    def device_module(cls) -> ModuleType:
        """torch's module for this kind of device (imported here, only once the platform is chosen)."""

    def device_name(self) -> str:
        name: str = self._module.get_device_name(self.device)
        return name

    def memory(self) -> MemoryUsage:
        free, total = self._module.mem_get_info(self.device)
        return MemoryUsage(used_bytes=total - free, total_bytes=total)

    def offload_store(self) -> OffloadStore:
        return self._store

    def synchronize(self) -> None:
        self._module.synchronize(self.device)

    def time_point(self) -> TimePoint:
        event = self._module.Event(enable_timing=True)
        event.record()
        return DevicePoint(event)

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """Copied into page-locked memory (from torch's caching host allocator: no new pinning per
        copy), which the device writes by DMA at full speed where a pageable copy is staged through
        a driver buffer; waits for that copy alone (its stream up to it)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = self._module.Event()
        done.record()
        done.synchronize()
        return host.numpy()

    def empty_cache(self) -> None:
        self._module.empty_cache()
