"""The CPU platform: the device is host memory; memory in use is the process's RSS."""

from __future__ import annotations

import os
import platform as host_platform
import shutil
from pathlib import Path

import torch

from runner_service.platforms.base import (
    MemoryUsage,
    Platform,
    host_memory_available_bytes,
    host_memory_total_bytes,
    process_rss_bytes,
)
from runner_service.platforms.offload import OffloadStore, SpillFileStore


class CpuPlatform(Platform):
    name = "cpu"
    DISTRIBUTED_BACKEND = "gloo"
    # The process RSS also moves with the interpreter's and the allocator's own pages.
    memory_noise_bytes = 2 * 1024 * 1024
    # One 512x512 step of the tiny Flux takes about 30 s on two cores, one 1024x1024 step minutes
    # and one 2048x2048 step (with its decode) more than ten, none of which a step boundary can stop.
    default_max_size = 512

    def __init__(self, spill_dir: Path | None = None) -> None:
        super().__init__(torch.device("cpu"))
        self._store = SpillFileStore(spill_dir)

    @classmethod
    def on_device(cls, index: int, spill_dir: Path | None) -> CpuPlatform:
        return cls(spill_dir)

    def device_name(self) -> str:
        return host_platform.processor() or host_platform.machine()

    def memory(self) -> MemoryUsage:
        return MemoryUsage(used_bytes=process_rss_bytes(), total_bytes=host_memory_total_bytes())

    def offload_store(self) -> OffloadStore:
        return self._store

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def empty_cache(self) -> None:
        self.release_host_memory()

    def compiles(self) -> bool:
        """Inductor builds CPU kernels with the host's C++ compiler (``CXX``, else g++)."""
        return shutil.which(os.environ.get("CXX", "g++")) is not None

    def fits_alongside(self, nbytes: int) -> bool:
        available = host_memory_available_bytes()
        return available is None or nbytes <= available
