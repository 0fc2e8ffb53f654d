"""LoRA adapters per request, through a real worker and runner, with adapters made with peft."""

from __future__ import annotations

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion.v1 import common_pb2, worker_pb2
from fixtures_runner import serve_tiny_as_built
from harness.processes import wait_until
from harness.streams import Stream
from lora_files import make_lora
from runner_service.models.catalog import ensure_builtin
from serving_common.errors import field_violations

W = worker_pb2
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        "style": make_lora(root / "style.safetensors", seed=1),
        "other": make_lora(root / "other.safetensors", seed=2, text_encoder=False),
        "kohya": make_lora(root / "kohya.safetensors", seed=1, layout="kohya"),
        "peft": make_lora(root / "peft.safetensors", seed=1, layout="peft"),
    }


@pytest.fixture(scope="module")
def pair(weights_pair):
    """The session's weights pair: its runner holds at most 2 adapters (--max-adapters 2)."""
    return weights_pair


@pytest.fixture(scope="module")
def stub(weights_stub):
    serve_tiny_as_built(weights_stub)  # whatever came before
    return weights_stub


def request(*adapters: tuple[str, float], seed: int = 7, request_id: str = "") -> W.GenerateRequest:
    return W.GenerateRequest(prompt="a red fox", num_inference_steps=3, seed=seed, request_id=request_id,
                             output_format=W.OUTPUT_FORMAT_RAW,
                             adapters=[common_pb2.AdapterRef(name=name, scale=scale) for name, scale in adapters])


def image(stub, *adapters: tuple[str, float], seed: int = 7) -> bytes:
    return stub.Generate(request(*adapters, seed=seed), timeout=120).images[0].data


def load(stub, name: str, path, pin: bool = False) -> common_pb2.AdapterInfo:
    return stub.LoadAdapter(W.LoadAdapterRequest(name=name, path=str(path), pin=pin), timeout=120).adapter


@pytest.fixture(scope="module")
def base(stub) -> bytes:
    return image(stub)


@pytest.fixture(autouse=True)
def no_adapters_after(stub):
    yield
    for adapter in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters:
        stub.UnloadAdapter(W.UnloadAdapterRequest(name=adapter.name), timeout=60)


def test_scale_zero_is_the_base_image_and_scale_one_changes_it(stub, base, files):
    adapter = load(stub, "style", files["style"])
    assert sorted(adapter.components) == ["text_encoder", "unet"] and adapter.resident
    assert adapter.parameter_bytes > 0 and len(adapter.digest) == 64
    assert image(stub, ("style", 0.0)) == base
    styled = image(stub, ("style", 1.0))
    assert styled != base
    assert image(stub, ("style", 1.0)) == styled  # deterministic
    assert image(stub) == base  # no adapter: LoRA off, not fused


def test_diffusers_kohya_and_peft_files_of_one_lora_give_one_image(stub, files):
    images = set()
    for layout in ("style", "kohya", "peft"):
        load(stub, layout, files[layout])
        images.add(image(stub, (layout, 1.0)))
        stub.UnloadAdapter(W.UnloadAdapterRequest(name=layout), timeout=60)
    assert len(images) == 1


def test_concurrent_requests_with_different_adapters_each_get_their_own(stub, base, files):
    load(stub, "style", files["style"])
    load(stub, "other", files["other"])
    alone = {name: image(stub, (name, 1.0), seed=11) for name in ("style", "other")}
    assert alone["style"] != alone["other"]
    futures = {name: stub.Generate.future(request(*[(name, 1.0)] if name else [], seed=11,
                                                  request_id=f"concurrent-{name or 'base'}"), timeout=120)
               for name in ("style", "other", "")}
    got = {name: future.result().images[0].data for name, future in futures.items()}
    assert got["style"] == alone["style"] and got["other"] == alone["other"]
    assert got[""] == image(stub, seed=11)
    # Two adapters at once, each at its scale.
    both = image(stub, ("style", 0.5), ("other", 0.5), seed=11)
    assert both not in (alone["style"], alone["other"])


def test_unloading_brings_the_base_image_back_and_unknown_adapters_are_refused(stub, base, files):
    load(stub, "style", files["style"])
    assert image(stub, ("style", 1.0)) != base
    stub.UnloadAdapter(W.UnloadAdapterRequest(name="style"), timeout=60)
    assert image(stub) == base
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request(("style", 1.0)), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "style" in field_violations(refused.value)["adapters[0].name"]
    with pytest.raises(grpc.RpcError) as missing:
        stub.UnloadAdapter(W.UnloadAdapterRequest(name="style"), timeout=30)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # With the last adapter gone, so are peft's wrappers: a level-2 sleep reloads the weights by
    # their checkpoint names, which a wrapped layer (to_q.base_layer.weight) would not have.
    stub.Sleep(W.SleepRequest(level=2), timeout=60)
    stub.WakeUp(W.WakeUpRequest(), timeout=60)
    assert image(stub) == base


def test_an_adapter_that_does_not_fit_is_refused_with_nothing_changed(stub, base, files, tmp_path):
    tensors = load_file(files["other"])
    name = next(key for key in tensors if "down" in key or "lora_A" in key)
    tensors[name] = torch.zeros(3, 5)  # the wrong shape for its layer
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    with pytest.raises(grpc.RpcError) as refused:
        load(stub, "bad", bad)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    assert "does not fit" in refused.value.details() and len(refused.value.details()) < 400
    assert list(stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters) == []
    assert image(stub) == base


def test_the_least_recently_used_adapter_is_evicted_and_loads_again_on_demand(stub, base, files, tmp_path):
    load(stub, "style", files["style"], pin=True)
    load(stub, "other", files["other"])
    styled, other = image(stub, ("style", 1.0)), image(stub, ("other", 1.0))
    load(stub, "third", make_lora(tmp_path / "third.safetensors", seed=3))  # --max-adapters 2: "other" goes
    listed = {a.name: a for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
    assert listed["style"].resident and listed["style"].pinned and listed["third"].resident
    assert not listed["other"].resident
    assert image(stub, ("other", 1.0)) == other  # loaded again, "third" evicted
    assert image(stub, ("style", 1.0)) == styled
    listed = {a.name: a for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
    assert listed["other"].resident and not listed["third"].resident
    assert listed["style"].requests >= 2
    status = stub.GetStatus(W.GetStatusRequest(), timeout=10)
    assert {a.name for a in status.adapters} == {"style", "other", "third"}


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_survive_sleep(stub, base, files, level):
    load(stub, "style", files["style"])
    styled = image(stub, ("style", 1.0))
    stub.Sleep(W.SleepRequest(level=level), timeout=60)
    stub.WakeUp(W.WakeUpRequest(), timeout=60)
    assert image(stub, ("style", 1.0)) == styled
    assert image(stub) == base


def test_a_restarted_runner_gets_its_adapters_back(pair, stub, files):
    load(stub, "style", files["style"])
    styled = image(stub, ("style", 1.0))
    first = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.instance_id
    pair.restart_runner()
    wait_until(lambda: (runner := stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0]).ready
               and runner.info.instance_id != first, 60, "re-applied")
    assert image(stub, ("style", 1.0)) == styled
    held = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.adapters
    assert [a.name for a in held] == ["style"]


def test_load_weights_and_checksums_keep_the_checkpoint_names_while_adapters_are_resident(stub, base, files,
                                                                                          tmp_path):
    before = stub.GetWeightsChecksum(W.GetWeightsChecksumRequest(), timeout=60).checksum
    load(stub, "style", files["style"])
    styled = image(stub, ("style", 1.0))
    assert stub.GetWeightsChecksum(W.GetWeightsChecksumRequest(), timeout=60).checksum == before
    unet = load_file(ensure_builtin("tiny") / "unet" / "diffusion_pytorch_model.safetensors")
    own = tmp_path / "unet.safetensors"
    save_file({f"unet.{name}": tensor for name, tensor in unet.items()}, str(own))
    loaded = stub.LoadWeights(W.LoadWeightsRequest(path=str(own)), timeout=60)
    assert len(loaded.loaded_names) == len(unet) and not any("base_layer" in n for n in loaded.loaded_names)
    assert image(stub, ("style", 1.0)) == styled and image(stub) == base
    stub.Init(W.InitRequest(model="tiny"), timeout=120)  # forgets the update (the adapters stay)


def test_adapter_names_are_those_peft_can_load(stub, base, files):
    """One pattern, letters, digits, '-' and '_' (peft refuses '.' in a module name), on worker and
    runner; a name torch's module dicts already use is refused by the runner, also on ``name``."""
    for name in ("style.v2", "style v2", "", "x" * 65):
        with pytest.raises(grpc.RpcError) as refused:
            load(stub, name, files["style"])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.details())
        assert "name" in field_violations(refused.value)
    with pytest.raises(grpc.RpcError) as reserved:
        load(stub, "train", files["style"])
    assert reserved.value.code() == grpc.StatusCode.INVALID_ARGUMENT, reserved.value.details()
    assert "torch" in field_violations(reserved.value)["name"]
    load(stub, "style-v2_1", files["style"])
    assert image(stub, ("style-v2_1", 1.0)) != base
    assert [a.name for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters] == ["style-v2_1"]


@pytest.mark.parametrize("spoil, why", [(lambda t: t.fill_(float("nan")), "holds NaN or infinite values"),
                                        (lambda t: t.mul_(1e30), "overflows")])
def test_an_adapter_with_non_finite_weights_or_updates_is_refused_naming_the_layer(stub, base, files, tmp_path,
                                                                                   spoil, why):
    """A NaN tensor, or tensors scaled by 1e30 (each finite, their product not), loaded and then
    made every image black; they are refused at LoadAdapter, with nothing changed."""
    tensors = load_file(files["style"])
    for name in sorted(tensors):
        if name.startswith("unet."):
            spoil(tensors[name])
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    with pytest.raises(grpc.RpcError) as refused:
        load(stub, "bad", bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    problem = field_violations(refused.value)["path"]
    assert why in problem and "unet." in problem and len(refused.value.details()) < 400
    assert list(stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters) == []
    assert image(stub) == base


def test_unloading_an_adapter_fails_the_queued_requests_using_it_as_unloaded(serial_pair, serial_stub, files):
    """UnloadAdapter waits for the batches running (they may use the adapter), then ends the queued
    requests naming it FAILED_PRECONDITION: they were valid when accepted. One request runs at a
    time (--max-batch-size 1), held in flight by its steps; the one with the adapter queues behind it."""
    stub = serial_stub
    load(stub, "style", files["style"])
    running = Stream(stub, W.GenerateRequest(request_id="running", prompt="held", num_inference_steps=500,
                                             output_format=W.OUTPUT_FORMAT_RAW))
    running.wait_step(1)
    queued = Stream(stub, request(("style", 1.0), request_id="queued"))
    assert queued.wait_for("queued").queued.position == 0
    unload = stub.UnloadAdapter.future(W.UnloadAdapterRequest(name="style"), timeout=120)
    wait_until(lambda: "adapter style: unloading once" in serial_pair.worker.log(), 30, "UnloadAdapter waiting")
    stub.Cancel(W.CancelRequest(request_id="running"), timeout=10)
    unload.result()
    queued.join()
    assert queued.error is not None and queued.error.code() == grpc.StatusCode.FAILED_PRECONDITION, queued.error
    assert "'style' was unloaded" in queued.error.details()
    assert not any(event.HasField("started") for event in queued.events)
    running.join()
    assert running.error.code() == grpc.StatusCode.CANCELLED
    assert not stub.GetStatus(W.GetStatusRequest(), timeout=10).active_requests


def queued_behind_init(pair, stub, model: str) -> tuple[Stream, W.InitResponse]:
    """A request naming ``style`` queued behind one held in flight by its steps (--max-batch-size 1),
    and an Init of ``model``, which waits for the running batch: once it does, the held request is
    cancelled. Returns the queued request's stream, ended, and the Init's response."""
    running = Stream(stub, W.GenerateRequest(request_id="init-running", prompt="held", num_inference_steps=500,
                                             output_format=W.OUTPUT_FORMAT_RAW))
    running.wait_step(1)
    queued = Stream(stub, request(("style", 1.0), request_id="init-queued"))
    assert queued.wait_for("queued").queued.position == 0
    waiting = f"Init of model {model} once the batches running now are done"
    seen = pair.worker.log().count(waiting)
    init = stub.Init.future(W.InitRequest(model=model), timeout=120)
    wait_until(lambda: pair.worker.log().count(waiting) > seen, 30, "Init waiting for the running batch")
    stub.Cancel(W.CancelRequest(request_id="init-running"), timeout=10)
    running.join()
    assert running.error is not None and running.error.code() == grpc.StatusCode.CANCELLED
    response = init.result()
    queued.join()
    return queued, response


@pytest.fixture
def serial_style(serial_stub, files):
    """``style`` loaded on the session's serial pair, which is left serving tiny without adapters."""
    load(serial_stub, "style", files["style"])
    yield serial_stub
    if serial_stub.GetStatus(W.GetStatusRequest(), timeout=10).model.source != "tiny":
        serial_stub.Init(W.InitRequest(model="tiny"), timeout=120)
    for adapter in serial_stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters:
        serial_stub.UnloadAdapter(W.UnloadAdapterRequest(name=adapter.name), timeout=60)


def test_init_of_the_model_loaded_keeps_its_adapters_for_the_requests_queued(serial_pair, serial_style):
    """Init of the model already loaded loads it afresh and registers its adapters again: the request
    queued meanwhile runs with its adapter (docs/design.md: only Init of another model drops them)."""
    stub = serial_style
    styled = image(stub, ("style", 1.0))
    queued, _ = queued_behind_init(serial_pair, stub, "tiny")
    assert queued.error is None and queued.done is not None, queued.error
    assert queued.done.images[0].data == styled
    assert [a.name for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters] == ["style"]


def test_init_of_another_model_fails_the_queued_requests_naming_its_adapters_as_unloaded(serial_pair, serial_style):
    """Init of another model (here tiny's own files, by path) drops the adapters: the queued request
    naming one ends FAILED_PRECONDITION, as after UnloadAdapter, without running."""
    stub = serial_style
    queued, response = queued_behind_init(serial_pair, stub, str(ensure_builtin("tiny")))
    assert response.model.source == str(ensure_builtin("tiny"))
    assert queued.error is not None and queued.error.code() == grpc.StatusCode.FAILED_PRECONDITION, queued.error
    assert "'style' was unloaded after this request was accepted" in queued.error.details()
    assert not any(event.HasField("started") for event in queued.events)
    assert list(stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters) == []
