"""Platforms hide the hardware: pick one with ``select_platform("auto" | "cpu" | "cuda[:N]" | "npu[:N]")``."""

from __future__ import annotations

from pathlib import Path

from runner_service.platforms.base import MemoryUsage, Platform
from runner_service.platforms.offload import OffloadStore

__all__ = ["MemoryUsage", "OffloadStore", "Platform", "select_platform"]


def _index(spec: str) -> int:
    _, _, index = spec.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"bad device index in {spec!r}")
    return int(index or 0)


def select_platform(spec: str = "auto", spill_dir: Path | None = None) -> Platform:
    """The platform for a ``--device`` value; ``auto`` prefers CUDA, then NPU, then CPU."""
    kind = spec.partition(":")[0]
    if kind == "auto":
        from runner_service.platforms.cuda import cuda_available
        from runner_service.platforms.npu import npu_installed

        kind = "cuda" if cuda_available() else "npu" if npu_installed() else "cpu"
        spec = kind
    if kind == "cpu":
        from runner_service.platforms.cpu import CpuPlatform

        return CpuPlatform(spill_dir)
    if kind == "cuda":
        from runner_service.platforms.cuda import CudaPlatform

        return CudaPlatform(_index(spec))
    if kind == "npu":
        from runner_service.platforms.npu import NpuPlatform

        return NpuPlatform(_index(spec))
    raise ValueError(f"unknown device {spec!r}; use auto, cpu, cuda[:N] or npu[:N]")
