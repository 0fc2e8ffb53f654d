"""The hardware interface every platform implements, and host-memory helpers they share."""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from runner_service.device_output import plain_copy
from runner_service.platforms.offload import OffloadStore
from serving_common.input_rules import INT8_WEIGHT_ONLY
from serving_common.memory import trim_host_heap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryUsage:
    used_bytes: int
    total_bytes: int


class TimePoint(Protocol):
    """A moment of the device's work, as the platform can mark it (``Platform.time_point``)."""

    def ms_since(self, earlier: TimePoint) -> float:
        """Milliseconds from ``earlier`` (a point of the same platform) to this point; on an
        accelerator this waits for the device to reach this point."""


@dataclass(frozen=True)
class HostPoint:
    """A moment on the host's monotonic clock: where device work is synchronous (the CPU)."""

    seconds: float = field(default_factory=time.perf_counter)

    def ms_since(self, earlier: TimePoint) -> float:
        if not isinstance(earlier, HostPoint):
            raise TypeError(f"a host point cannot be compared with {type(earlier).__name__}")
        return (self.seconds - earlier.seconds) * 1000


def process_rss_bytes() -> int:
    """Resident set size of this process, read from /proc (what the OS really holds for us)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def host_memory_total_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_available_bytes() -> int | None:
    """What the kernel says can still be allocated without swapping (MemAvailable); None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Platform(ABC):
    """One kind of hardware: its device, its memory, and where sleeping weights go.

    One runner serves one device, so a platform instance is bound to one device index.
    """

    name: str
    # The torch.distributed backend whose collectives run on this kind of device: what a runner
    # group over several of them joins with (runner_service.group.launch).
    DISTRIBUTED_BACKEND: str
    # How far memory readings move on their own; a sleep that "grows" memory by less is noise.
    memory_noise_bytes: int = 0
    # The attention backends of diffusers' dispatcher that can run here (those whose package is not
    # installed are left out when a model is offered them): torch's own SDPA and its math kernel.
    attention_backends: tuple[str, ...] = ("native", "_native_math")
    # The largest width or height a runner here generates unless told (--max-size 0).
    default_max_size: int = 2048

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    @abstractmethod
    def on_device(cls, index: int, spill_dir: Path | None) -> Platform:
        """The platform bound to device ``index`` of its kind; ``spill_dir``: where a platform that
        spills sleeping weights to files keeps them."""

    @abstractmethod
    def device_name(self) -> str: ...

    @abstractmethod
    def memory(self) -> MemoryUsage:
        """Memory in use on the device and its total."""

    @abstractmethod
    def offload_store(self) -> OffloadStore:
        """Where sleep level 1 keeps weights while they are off the device."""

    def synchronize(self) -> None:
        """Waits for queued device work; a no-op where work is synchronous."""

    def time_point(self) -> TimePoint:
        """Marks now in the device's work (what was queued before it), for phase timings: the
        host's clock here; an accelerator records a device event, so queued work is not
        mistaken for done work and marking never waits."""
        return HostPoint()

    def to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """The tensor's values in host memory, once the device has made them: here (the CPU) the
        tensor's own memory; an accelerator copies through pinned memory."""
        return plain_copy(tensor)

    def empty_cache(self) -> None:
        """Returns cached, unused device memory to the device's driver."""

    def default_dtype(self) -> torch.dtype:
        return torch.float16

    def release_host_memory(self) -> None:
        trim_host_heap()

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether ``error`` says the device ran out of memory (the caller may free some and retry).

        torch's out-of-memory errors of every backend say so in their message ("CUDA out of
        memory", "NPU out of memory").
        """
        return isinstance(error, MemoryError) or "out of memory" in str(error).lower()

    def fits_alongside(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more are likely to fit while the current model stays loaded.

        Accelerators say yes and let an out-of-memory error tell otherwise; the CPU checks
        first, because there running out of memory ends the process.
        """
        return True

    def quantizations(self) -> tuple[str, ...]:
        """The weight quantizations (``Acceleration.quantization``) whose kernels run here."""
        return (INT8_WEIGHT_ONLY,)

    def compiles(self) -> bool:
        """Whether torch.compile can build kernels here (Triton on accelerators)."""
        return True

    def describe(self) -> str:
        return f"{self.name} ({self.device_name()})"
