"""The CUDA platform: the only module that names ``torch.cuda``."""

from __future__ import annotations

from types import ModuleType

import torch

from runner_service.platforms.accelerator import AcceleratorPlatform
from serving_common.input_rules import FLOAT8_WEIGHT_ONLY, INT8_WEIGHT_ONLY


def cuda_available() -> bool:
    return torch.cuda.is_available()


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    DISTRIBUTED_BACKEND = "nccl"
    # torch's SDPA kernels, FlexAttention, and the packages diffusers dispatches to where installed.
    attention_backends = ("native", "_native_flash", "_native_efficient", "_native_cudnn", "_native_math", "flex",
                          "flash", "flash_varlen", "_flash_3", "_flash_varlen_3", "sage", "sage_varlen", "xformers")

    @classmethod
    def device_module(cls) -> ModuleType:
        return torch.cuda

    def quantizations(self) -> tuple[str, ...]:
        """float8 weights need Ada or Hopper (compute capability 8.9) or later."""
        if torch.cuda.get_device_capability(self.device) >= (8, 9):
            return (INT8_WEIGHT_ONLY, FLOAT8_WEIGHT_ONLY)
        return (INT8_WEIGHT_ONLY,)
