"""The Ascend NPU platform, through ``torch_npu`` (imported only when this platform is selected)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from runner_service.platforms.accelerator import AcceleratorPlatform


def npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    DISTRIBUTED_BACKEND = "hccl"  # torch_npu's collectives, registered when torch_npu is imported
    attention_backends = ("native", "_native_npu", "_native_math")

    @classmethod
    def device_module(cls) -> ModuleType:
        # Importing torch_npu registers torch.npu, which is torch_npu.npu: take it from there, where
        # it is known to exist.
        module: ModuleType = importlib.import_module("torch_npu").npu
        return module
