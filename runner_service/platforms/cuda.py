"""The CUDA platform: the only module that names ``torch.cuda``."""

from __future__ import annotations

import torch

from runner_service.platforms.accelerator import AcceleratorPlatform


def cuda_available() -> bool:
    return torch.cuda.is_available()


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        super().__init__(torch.cuda, index)
