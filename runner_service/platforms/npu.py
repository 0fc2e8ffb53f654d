"""The Ascend NPU platform, through ``torch_npu`` (imported only when this platform is selected)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from runner_service.platforms.accelerator import AcceleratorPlatform


def npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


class NpuPlatform(AcceleratorPlatform):
    name = "npu"

    def __init__(self, index: int = 0) -> None:
        importlib.import_module("torch_npu")  # registers torch.npu
        super().__init__(torch.npu, index)
