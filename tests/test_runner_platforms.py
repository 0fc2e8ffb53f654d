"""Platforms without the hardware: the accelerator base class against a stand-in device module, and the
runner's --dtype flag, whose default is the platform's."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from runner_service.platforms import select_platform
from runner_service.platforms.accelerator import AcceleratorPlatform
from runner_service.platforms.cuda import CudaPlatform, cuda_available

GIB = 1024**3
pytestmark = pytest.mark.unit


def fake_accelerator(module: SimpleNamespace) -> type[AcceleratorPlatform]:
    """An accelerator platform over a stand-in device module."""
    class FakeAccelerator(AcceleratorPlatform):
        name = "cuda"  # a device type torch knows, so torch.device() accepts it without the hardware

        @classmethod
        def device_module(cls) -> SimpleNamespace:
            return module

    return FakeAccelerator


def device_module(available: bool = True, count: int = 2) -> SimpleNamespace:
    calls: list[str] = []
    return SimpleNamespace(
        calls=calls,
        is_available=lambda: available,
        device_count=lambda: count,
        set_device=lambda device: calls.append(f"set_device {device}"),
        get_device_name=lambda device: "Fake 9000",
        mem_get_info=lambda device: (3 * GIB, 8 * GIB),
        synchronize=lambda device: calls.append(f"synchronize {device}"),
        empty_cache=lambda: calls.append("empty_cache"),
    )


def test_an_accelerator_goes_through_its_device_module():
    module = device_module()
    platform = fake_accelerator(module).on_device(1, None)
    assert platform.device == torch.device("cuda", 1)
    assert platform.describe() == "cuda (Fake 9000)"
    memory = platform.memory()
    assert (memory.used_bytes, memory.total_bytes) == (5 * GIB, 8 * GIB)
    platform.synchronize()
    platform.empty_cache()
    assert module.calls == ["set_device cuda:1", "synchronize cuda:1", "empty_cache"]


@pytest.mark.parametrize("available, index, words", [(False, 0, "is_available() is False"),
                                                     (True, 2, "cuda:2 requested but only 2 devices exist")])
def test_an_accelerator_that_is_not_there_is_refused(available, index, words):
    with pytest.raises(RuntimeError, match=re.escape(words)):
        fake_accelerator(device_module(available=available)).on_device(index, None)


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_and_auto_picks_the_cpu():
    with pytest.raises(RuntimeError, match="CUDA was requested"):
        CudaPlatform()
    platform = select_platform("auto")
    platform.offload_store().close()
    assert platform.name == "cpu"


def test_dtype_flag_takes_the_protocol_names_and_defaults_to_the_platform(monkeypatch):
    from runner_service.main import parse_args

    assert parse_args([]).dtype is None
    assert parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse_args(["--dtype", ""])
    monkeypatch.setenv("DIFFUSION_RUNNER_DTYPE", "fp16")  # environment defaults bypass argparse's choices
    with pytest.raises(SystemExit):
        parse_args([])
