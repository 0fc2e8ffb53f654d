"""Platforms hide the hardware: pick one with ``select_platform("auto" | "cpu" | "cuda[:N]" | "npu[:N]")``."""

from __future__ import annotations

import importlib
from pathlib import Path

from runner_service.platforms.base import HostPoint, MemoryUsage, Platform, TimePoint
from runner_service.platforms.offload import OffloadStore

__all__ = ["HostPoint", "MemoryUsage", "OffloadStore", "Platform", "TimePoint", "distributed_backend", "group_devices",
           "select_platform"]


def _index(spec: str) -> int:
    _, _, index = spec.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"bad device index in {spec!r}")
    return int(index or 0)


def _resolve_auto(kind: str) -> str:
    """The device kind ``auto`` stands for here (CUDA, then NPU, then CPU); other kinds as given."""
    if kind != "auto":
        return kind
    from runner_service.platforms.cuda import cuda_available
    from runner_service.platforms.npu import npu_installed

    return "cuda" if cuda_available() else "npu" if npu_installed() else "cpu"


# Each device kind's platform class, imported only when asked for.
_PLATFORMS = {
    "cpu": "runner_service.platforms.cpu.CpuPlatform",
    "cuda": "runner_service.platforms.cuda.CudaPlatform",
    "npu": "runner_service.platforms.npu.NpuPlatform",
}


def select_platform(spec: str = "auto", spill_dir: Path | None = None) -> Platform:
    """The platform for a ``--device`` value; ``auto`` prefers CUDA, then NPU, then CPU."""
    kind = spec.partition(":")[0]
    if kind == "auto":
        kind = spec = _resolve_auto(kind)
    platform = _platform_class(kind)
    if platform is None:
        raise ValueError(f"unknown device {spec!r}; use auto, cpu, cuda[:N] or npu[:N]")
    return platform.on_device(_index(spec), spill_dir)


def _platform_class(kind: str) -> type[Platform] | None:
    """The platform class of a device kind, imported but not instantiated: instantiating one binds
    its device (and torch_npu is imported only then)."""
    path = _PLATFORMS.get(kind)
    if path is None:
        return None
    module, _, name = path.rpartition(".")
    platform: type[Platform] = getattr(importlib.import_module(module), name)
    return platform


def distributed_backend(device: str) -> str:
    """The torch.distributed backend of one rank's device (``cpu``, ``cuda:1``, ``npu:0``), said by
    its platform class without touching the device: rank 0 checks every rank's device with it
    before any process starts. An accelerator needs its index, since each rank binds its own."""
    kind, _, index = device.partition(":")
    platform = _platform_class(kind)
    if platform is None:
        raise ValueError(f"devices: unknown device {device!r}; use cpu, cuda:N or npu:N")
    if kind != "cpu" and not index.isdigit():
        raise ValueError(f"devices: {device!r} needs its index ({kind}:N): each rank binds its own device")
    return platform.DISTRIBUTED_BACKEND


def group_devices(spec: str, device: str) -> list[str]:
    """One device per rank from the runner's ``--devices`` value, given its ``--device``.

    ``""``: no group (the runner serves ``--device`` alone). ``"N"``: N devices of ``--device``'s
    kind (``auto`` resolved as ``select_platform`` does), ``cuda:0`` .. ``cuda:N-1`` on an
    accelerator and N times ``cpu`` on the CPU (gloo ranks share the host). A comma-separated list
    (``cuda:0,cuda:2``) names each rank's device; one kind only, since every rank joins one backend.
    """
    spec = spec.strip()
    if not spec:
        return []
    if spec.isdigit():
        count = int(spec)
        if count < 1:
            raise ValueError(f"devices: {spec!r} asks for no device; give a count of at least 1 or leave it empty")
        kind, _, index = device.partition(":")
        if index:
            raise ValueError(f"devices: a count takes --device's kind, but --device {device!r} names one device; "
                             "list the group's devices instead (cuda:0,cuda:1)")
        kind = _resolve_auto(kind)
        devices = ["cpu"] * count if kind == "cpu" else [f"{kind}:{rank}" for rank in range(count)]
    else:
        devices = [part.strip() for part in spec.split(",")]
    for member in devices:
        distributed_backend(member)
    kinds = sorted({member.partition(":")[0] for member in devices})
    if len(kinds) > 1:
        raise ValueError(f"devices: {spec!r} mixes {' and '.join(kinds)}; a group's ranks share one backend")
    given = device.partition(":")[0]
    if given not in ("auto", kinds[0]):
        raise ValueError(f"devices: {spec!r} are {kinds[0]} devices but --device is {device!r}")
    repeated = sorted({member for member in devices if member != "cpu" and devices.count(member) > 1})
    if repeated:
        raise ValueError(f"devices: {', '.join(repeated)} named more than once; each rank needs its own device")
    return devices
