"""Device work whose caller is gone takes no effect, and a LoadModel that cannot fit next to the model
puts the old one back if it fails: the real servicer in this process (its slow phases slowed on
purpose), behind a real gRPC server where deadlines and cancellation matter."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import torch
from safetensors.torch import save_file

from diffusion.v1 import runner_pb2, runner_pb2_grpc
from runner_service import model_slot as model_slot_module
from runner_service import weights as weights_module
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.device_gate import CallWatch
from runner_service.loaded_model import DeviceOutOfMemory, check_source, load_model
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache
from runner_service.service import RunnerServicer
from serving_common.errors import ServiceError, failed_precondition
from serving_common.server import EXCLUSIVE_PORT

pytestmark = pytest.mark.process

R = runner_pb2
SLOW = 1.0  # seconds a slowed phase takes
DEADLINE = 0.3


@pytest.fixture(scope="module")
def tiny(cpu_platform):
    return load_model(check_source("tiny", None, ModelRoots(), HubCache()), None, cpu_platform)


def serving(platform, model) -> RunnerServicer:
    """A servicer of a host with ``model`` loaded."""
    host = ModelHost(platform, RunnerConfig())
    host.slot.model = model
    return RunnerServicer(host)


def fresh(servicer: RunnerServicer) -> RunnerServicer:
    """A servicer of the same model with a device gate of its own (a gate belongs to one event loop)."""
    return serving(servicer.host.platform, servicer.host.model)


@pytest.fixture
def servicer(cpu_platform, tiny):
    return serving(cpu_platform, tiny)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value.detach().clone() for name, component in model.components.items()
            for key, value in component.module.state_dict().items()}


def same(model, before: dict[str, torch.Tensor]) -> bool:
    now = snapshot(model)
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


def slowed(function, seconds: float = SLOW):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)

    return slow


async def serve(servicer: RunnerServicer, scenario) -> None:
    """Runs ``scenario(stub)`` against ``servicer`` behind a real server, then waits for its device work."""
    server = grpc.aio.server(options=[EXCLUSIVE_PORT])
    runner_pb2_grpc.add_RunnerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await scenario(runner_pb2_grpc.RunnerServiceStub(channel))
        async with servicer.host.gate.exclusive():  # the abandoned work is done once the device is free
            pass
    finally:
        await server.stop(None)


async def ends_with(call, code: grpc.StatusCode, servicer: RunnerServicer) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        assert error.code() == code
    except asyncio.CancelledError:  # what awaiting a call cancelled here raises
        assert code == grpc.StatusCode.CANCELLED
    else:
        raise AssertionError("the call succeeded")
    # The slowed work still runs in its thread, and keeps the device until it is done.
    assert servicer.host.gate.busy


@pytest.fixture
def weights_file(tmp_path, tiny):
    conv_in = tiny.components["unet"].module.conv_in.weight.detach()
    path = tmp_path / "perturbed.safetensors"
    save_file({"unet.conv_in.weight": conv_in + 1.0}, path)
    return path


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
def test_load_weights_whose_call_ended_applies_nothing(servicer, tiny, weights_file, monkeypatch, caplog, ending):
    monkeypatch.setattr(weights_module, "read_tensors", slowed(weights_module.read_tensors))
    before, version = snapshot(tiny), tiny.weights_version
    request = R.RunnerServiceLoadWeightsRequest(path=str(weights_file))

    async def scenario(stub) -> None:
        if ending == "deadline":
            await ends_with(stub.LoadWeights(request, timeout=DEADLINE), grpc.StatusCode.DEADLINE_EXCEEDED, servicer)
        else:
            call = stub.LoadWeights(request)
            await asyncio.sleep(DEADLINE)
            call.cancel()
            await ends_with(call, grpc.StatusCode.CANCELLED, servicer)

    with caplog.at_level(logging.WARNING, "runner_service"):
        asyncio.run(serve(servicer, scenario))
    assert tiny.weights_version == version and tiny.weight_updates == []
    assert same(tiny, before)
    assert "LoadWeights abandoned" in caplog.text
    # With time to finish, the same request applies.
    monkeypatch.undo()
    loaded = asyncio.run(fresh(servicer).LoadWeights(request, FakeContext()))
    assert loaded.weights_version != version
    tiny.weight_updates.clear()
    tiny.components["unet"].module.conv_in.weight.data.copy_(before["unet.conv_in.weight"])


def test_sleep_and_wake_whose_call_ended_change_nothing(servicer, tiny, cpu_platform, monkeypatch):
    before = snapshot(tiny)
    store = cpu_platform.offload_store()
    with monkeypatch.context() as patch:
        patch.setattr(store, "put", slowed(store.put, SLOW / 2))
        asyncio.run(serve(servicer, lambda stub: ends_with(
            stub.Sleep(R.RunnerServiceSleepRequest(level=1), timeout=DEADLINE),
            grpc.StatusCode.DEADLINE_EXCEEDED, servicer)))
    assert tiny.asleep_components() == [] and same(tiny, before)
    assert list(store.directory.glob("*.safetensors")) == []

    servicer = fresh(servicer)
    servicer.host.slot.sleeper.sleep(tiny, 1, [])
    with monkeypatch.context() as patch:
        patch.setattr(store, "get", slowed(store.get, SLOW / 2))
        asyncio.run(serve(servicer, lambda stub: ends_with(
            stub.WakeUp(R.RunnerServiceWakeUpRequest(), timeout=DEADLINE),
            grpc.StatusCode.DEADLINE_EXCEEDED, servicer)))
    assert tiny.asleep_components() == list(tiny.components)
    servicer.host.slot.sleeper.wake(tiny, [])
    assert same(tiny, before)


def test_load_model_whose_call_ended_keeps_the_model(servicer, tiny, monkeypatch):
    monkeypatch.setattr(model_slot_module, "load_model", slowed(load_model))
    asyncio.run(serve(servicer, lambda stub: ends_with(
        stub.LoadModel(R.LoadModelRequest(source="tiny"), timeout=DEADLINE),
        grpc.StatusCode.DEADLINE_EXCEEDED, servicer)))
    assert servicer.host.model is tiny


class FakeContext:
    """What the servicer asks of a call's context, for a call with no deadline that never ends early."""

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort_with_status(self, status) -> None:
        raise ServiceError(grpc.StatusCode(status.code), status.details)

    async def abort(self, code, details) -> None:
        raise ServiceError(code, details)


def loads(monkeypatch, servicer: RunnerServicer, *outcomes: Exception) -> list:
    """``load_model`` raising ``outcomes`` in turn, then really loading; returns the list of the
    model in place at each call."""
    remaining, seen = list(outcomes), []

    def fake(checked, dtype_name, platform, adapters, plan, controlnets):
        seen.append(servicer.host.model)
        if remaining:
            raise remaining.pop(0)
        return load_model(checked, dtype_name, platform, adapters, plan, controlnets)

    monkeypatch.setattr(model_slot_module, "load_model", fake)
    return seen


def test_out_of_memory_next_to_the_model_unloads_it_first(servicer, tiny, monkeypatch):
    seen = loads(monkeypatch, servicer, DeviceOutOfMemory("CUDA out of memory"))
    asyncio.run(servicer.host.load("tiny", None, CallWatch("LoadModel")))
    assert seen == [tiny, None]  # tried alongside, then with the old one unloaded
    assert servicer.host.model is not None and servicer.host.model is not tiny


def test_a_failed_load_after_unloading_loads_the_previous_model_back(servicer, tiny, monkeypatch):
    seen = loads(monkeypatch, servicer, DeviceOutOfMemory("CUDA out of memory"), failed_precondition("broken unet"))
    with pytest.raises(ServiceError) as error:
        asyncio.run(servicer.host.load("tiny", None, CallWatch("LoadModel")))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.message == ("broken unet; the previous model 'tiny' was loaded back from its source, "
                                   "without its weight updates")
    assert seen == [tiny, None, None]
    assert servicer.host.model is not None and servicer.host.model.source == "tiny"


def test_a_model_that_may_not_fit_in_host_memory_is_loaded_after_unloading(servicer, tiny, cpu_platform, monkeypatch):
    seen = loads(monkeypatch, servicer)
    monkeypatch.setattr(cpu_platform, "fits_alongside", lambda nbytes: False)
    asyncio.run(servicer.host.load("tiny", None, CallWatch("LoadModel")))
    assert seen == [None]
