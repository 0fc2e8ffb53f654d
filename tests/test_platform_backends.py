"""The platform layer names each device kind's torch.distributed backend and turns ``--devices`` into
one device per rank, without touching a device: this machine has no CUDA and no torch_npu, so a
platform instantiated here would fail, and these answers must not need one."""

from __future__ import annotations

import sys

import pytest

import runner_service.platforms.cuda as cuda_module
import runner_service.platforms.npu as npu_module
from runner_service.platforms import distributed_backend, group_devices, select_platform
from runner_service.platforms.cpu import CpuPlatform
from runner_service.platforms.cuda import CudaPlatform
from runner_service.platforms.npu import NpuPlatform

pytestmark = pytest.mark.unit


def test_each_platform_class_names_its_backend() -> None:
    assert (CpuPlatform.DISTRIBUTED_BACKEND, CudaPlatform.DISTRIBUTED_BACKEND, NpuPlatform.DISTRIBUTED_BACKEND) == (
        "gloo", "nccl", "hccl")


def test_the_cpu_backend_is_gloo() -> None:
    assert distributed_backend("cpu") == "gloo"


@pytest.mark.parametrize(("device", "backend"), [("cuda:0", "nccl"), ("cuda:3", "nccl"), ("npu:0", "hccl"),
                                                 ("npu:7", "hccl")])
def test_an_accelerator_backend_is_read_from_its_class_without_binding_the_device(device: str, backend: str) -> None:
    assert not cuda_module.cuda_available() and not npu_module.npu_installed()  # the premise of this test
    assert distributed_backend(device) == backend
    assert "torch_npu" not in sys.modules
    # what instantiating the platform does here: no CUDA device, no torch_npu to import
    with pytest.raises((RuntimeError, ImportError)):
        select_platform(device)


@pytest.mark.parametrize(("device", "refusal"), [
    ("tpu:0", "devices: unknown device 'tpu:0'; use cpu, cuda:N or npu:N"),
    ("auto", "devices: unknown device 'auto'"),
    ("", "devices: unknown device ''"),
    ("cuda", "devices: 'cuda' needs its index (cuda:N)"),
    ("npu:", "devices: 'npu:' needs its index (npu:N)"),
    ("cuda:x", "devices: 'cuda:x' needs its index"),
])
def test_distributed_backend_refuses_what_no_rank_could_bind(device: str, refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        distributed_backend(device)
    assert str(refused.value).startswith(refusal)


@pytest.mark.parametrize(("spec", "device", "devices"), [
    ("", "cuda", []),
    ("  ", "cpu", []),
    ("1", "cpu", ["cpu"]),
    ("3", "cpu", ["cpu", "cpu", "cpu"]),
    ("4", "cuda", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("2", "npu", ["npu:0", "npu:1"]),
    ("cuda:0,cuda:2", "cuda", ["cuda:0", "cuda:2"]),
    ("cuda:1, cuda:0", "auto", ["cuda:1", "cuda:0"]),
    ("cpu,cpu", "cpu", ["cpu", "cpu"]),
    ("npu:3", "npu", ["npu:3"]),
])
def test_group_devices_gives_one_device_per_rank(spec: str, device: str, devices: list[str]) -> None:
    assert group_devices(spec, device) == devices


def test_a_count_on_auto_takes_the_kind_auto_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    assert group_devices("2", "auto") == ["cpu", "cpu"]  # no CUDA and no torch_npu here
    monkeypatch.setattr(npu_module, "npu_installed", lambda: True)
    assert group_devices("2", "auto") == ["npu:0", "npu:1"]
    monkeypatch.setattr(cuda_module, "cuda_available", lambda: True)  # the device this machine lacks
    assert group_devices("2", "auto") == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(("spec", "device", "refusal"), [
    ("0", "cuda", "devices: '0' asks for no device"),
    ("-2", "cuda", "devices: unknown device '-2'"),
    ("two", "cpu", "devices: unknown device 'two'"),
    ("2", "cuda:1", "devices: a count takes --device's kind, but --device 'cuda:1' names one device"),
    ("2", "tpu", "devices: unknown device 'tpu:0'"),
    ("cuda:0,cuda", "cuda", "devices: 'cuda' needs its index (cuda:N)"),
    ("cuda:0,,cuda:1", "cuda", "devices: unknown device ''"),
    ("cuda:0,npu:0", "auto", "devices: 'cuda:0,npu:0' mixes cuda and npu; a group's ranks share one backend"),
    ("cpu,cuda:0", "cpu", "devices: 'cpu,cuda:0' mixes cpu and cuda"),
    ("npu:0,npu:1", "cuda", "devices: 'npu:0,npu:1' are npu devices but --device is 'cuda'"),
    ("cuda:0,cuda:1,cuda:0", "cuda", "devices: cuda:0 named more than once; each rank needs its own device"),
])
def test_group_devices_refuses_naming_the_field(spec: str, device: str, refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        group_devices(spec, device)
    assert str(refused.value).startswith(refusal)
