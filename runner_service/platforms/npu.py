"""The Ascend NPU platform, through ``torch_npu`` (imported only when this platform is selected)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from runner_service.platforms.base import MemoryUsage, Platform
from runner_service.platforms.offload import OffloadStore, PinnedHostStore


def npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


class NpuPlatform(Platform):
    name = "npu"

    def __init__(self, index: int = 0) -> None:
        importlib.import_module("torch_npu")  # registers torch.npu
        if not torch.npu.is_available():
            raise RuntimeError("NPU was requested but torch.npu.is_available() is False")
        super().__init__(torch.device("npu", index))
        torch.npu.set_device(self.device)
        self._store = PinnedHostStore(self.synchronize)

    def device_name(self) -> str:
        return torch.npu.get_device_name(self.device)

    def memory(self) -> MemoryUsage:
        free, total = torch.npu.mem_get_info(self.device)
        return MemoryUsage(used_bytes=total - free, total_bytes=total)

    def offload_store(self) -> OffloadStore:
        return self._store

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()
