"""The CUDA platform: the only module that calls ``torch.cuda``."""

from __future__ import annotations

import torch

from runner_service.platforms.base import MemoryUsage, Platform
from runner_service.platforms.offload import OffloadStore, PinnedHostStore


def cuda_available() -> bool:
    return torch.cuda.is_available()


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA was requested but torch.cuda.is_available() is False")
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"cuda:{index} requested but only {torch.cuda.device_count()} devices exist")
        super().__init__(torch.device("cuda", index))
        torch.cuda.set_device(self.device)
        self._store = PinnedHostStore(self.synchronize)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def memory(self) -> MemoryUsage:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryUsage(used_bytes=total - free, total_bytes=total)

    def offload_store(self) -> OffloadStore:
        return self._store

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
