"""ControlNets and IP-Adapters through the worker (issue 39 items 2-4): registration by kind, the
desired state that keeps it (runner restart, worker restart with --state-file), each refusal of
``controls`` and ``ip_adapter``, the decoded images the runner receives, and the generation
parameters of a PNG naming them.

The real worker process runs against in-process fake runners (``tests/fake_runner.py``, served from
a thread of this process, so the test reads what each Execute carried): ``taking`` reports a family
that takes ControlNets and IP-Adapters, ``plain`` one that takes neither.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from PIL import Image

from conditioning_support import CONTROLNET, IP_ADAPTER, FakeRunners, png
from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from fake_runner import FakeRunner
from harness.processes import ServiceProcess, start_worker, wait_until
from harness.streams import Stream
from serving_common.errors import field_violations

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

W = worker_pb2
C = common_pb2
MAX_INPUT_BYTES = 300_000


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeRunners]:
    runners = FakeRunners(tmp_path_factory.mktemp("conditioning-fakes"))
    runners.start("taking", [CONTROLNET, IP_ADAPTER])
    runners.start("plain", [])
    yield runners
    runners.close()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A directory for each adapter the tests register (the fake runner takes any that exists)."""
    root = tmp_path_factory.mktemp("conditioning-adapters")
    for name in ("edges", "depth", "style", "lora"):
        (root / name).mkdir()
    return {name: str(root / name) for name in ("edges", "depth", "style", "lora")}


@pytest.fixture(scope="module")
def state_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conditioning-state") / "state.json"


def ready_stub(worker: ServiceProcess) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerServiceStub]:
    channel = grpc.insecure_channel(worker.target)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY, 30,
               "the worker ready")
    return channel, stub


@pytest.fixture(scope="module")
def worker(fakes: FakeRunners, state_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """The worker on ``taking``: one request at a time, a small input budget, its state in ``state_file``."""
    process = start_worker(tmp_path_factory.mktemp("conditioning-worker"), fakes.target("taking"),
                           "--model", "fake-sd", "--max-batch-size", "1", "--max-batch-delay-ms", "0",
                           "--max-input-bytes", str(MAX_INPUT_BYTES), "--state-file", str(state_file))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(worker: ServiceProcess, adapter_dirs: dict[str, str]) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A stub to ``worker`` with ControlNets edges and depth, IP-Adapter style and LoRA lora registered."""
    channel, stub = ready_stub(worker)
    for name, kind in (("edges", CONTROLNET), ("depth", CONTROLNET), ("style", IP_ADAPTER), ("lora", 0)):
        stub.LoadAdapter(W.LoadAdapterRequest(name=name, path=adapter_dirs[name], kind=kind), timeout=30)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def plain_stub(fakes: FakeRunners, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A stub to a worker on ``plain``, whose model's family takes neither ControlNets nor IP-Adapters."""
    process = start_worker(tmp_path_factory.mktemp("plain-worker"), fakes.target("plain"), "--model", "fake-plain")
    channel, stub = ready_stub(process)
    yield stub
    channel.close()
    process.stop()


def request(**fields: Any) -> worker_pb2.GenerateRequest:
    """A 64x64 2-step request with raw output; ``fields`` replace any of it."""
    return W.GenerateRequest(**{"prompt": "a fox", "width": 64, "height": 64, "num_inference_steps": 2, "seed": 3,
                                "output_format": W.OUTPUT_FORMAT_RAW, **fields})


def control(name: str = "edges", image: bytes | None = None, **fields: Any) -> C.ControlInput:
    return C.ControlInput(name=name, image=png(64, 64) if image is None else image, **fields)


def refusal(stub: worker_pb2_grpc.WorkerServiceStub, generate: worker_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(generate, timeout=30)
    return caught.value


def test_each_kind_is_registered_listed_and_reported_as_such(stub, fakes):
    listed = {a.name: a.kind for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
    assert listed == {"edges": CONTROLNET, "depth": CONTROLNET, "style": IP_ADAPTER, "lora": C.ADAPTER_KIND_UNSPECIFIED}
    status = {a.name: a.kind for a in stub.GetStatus(W.GetStatusRequest(), timeout=10).adapters}
    assert status == listed
    assert {name: a.kind for name, a in fakes.fakes["taking"].adapters.items()} == listed  # the kind went through


def test_controls_and_an_image_prompt_reach_the_runner_decoded_with_their_defaults(stub, fakes):
    response = stub.Generate(request(
        controls=[control("edges", png(40, 24)), control("depth", conditioning_scale=0.5, guidance_start=0.2,
                                                         guidance_end=0.8)],
        ip_adapter=C.ImagePrompt(name="style", images=[png(24, 16), png(32, 48, mode="L")], scale=0.7),
        resize_mode=W.RESIZE_MODE_RESIZE, request_id="conditioned"), timeout=30)
    assert len(response.images) == 1
    [item] = next(e for e in fakes.fakes["taking"].executes if e.items[0].request_id == "conditioned").items
    assert [(c.name, c.conditioning_scale, c.guidance_start, c.guidance_end) for c in item.controls] == [
        ("edges", 1.0, 0.0, 1.0), ("depth", 0.5, pytest.approx(0.2), pytest.approx(0.8))]
    for given in item.controls:  # fitted to the request's size, 3 channels
        assert (given.image.width, given.image.height, given.image.channels) == (64, 64, 3)
        assert len(given.image.pixels) == 64 * 64 * 3
    prompt = item.ip_adapter
    assert prompt.name == "style" and prompt.scale == pytest.approx(0.7)
    assert [(i.width, i.height, i.channels) for i in prompt.images] == [(24, 16, 3), (32, 48, 3)]  # their own sizes


def test_a_png_names_its_controls_and_image_prompt_never_their_images(stub):
    response = stub.Generate(request(
        controls=[control("edges", conditioning_scale=0.5, guidance_end=0.8), control("depth")],
        ip_adapter=C.ImagePrompt(name="style", images=[png(24, 16), png(16, 16)], scale=0.7),
        output_format=W.OUTPUT_FORMAT_PNG), timeout=30)
    [image] = response.images
    with Image.open(io.BytesIO(image.data)) as file:
        settings = file.text["parameters"].splitlines()[-1]
    assert settings.endswith('ControlNet 0: "Model: edges, Weight: 0.5, Guidance Start: 0, Guidance End: 0.8", '
                             'ControlNet 1: "Model: depth, Weight: 1, Guidance Start: 0, Guidance End: 1", '
                             'IP-Adapter: "Model: style, Weight: 0.7, Images: 2"'), settings
    parameters = json_format.MessageToDict(image.parameters)
    assert parameters["controls"][0] == {"name": "edges", "conditioning_scale": 0.5, "guidance_start": 0.0,
                                         "guidance_end": 0.8}
    assert parameters["ip_adapter"] == {"name": "style", "scale": 0.7, "images": 2.0}


def test_requests_are_counted_per_controlnet_and_ip_adapter(stub):
    before = {a.name: a.requests for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
    stub.Generate(request(controls=[control("edges"), control("edges", conditioning_scale=0.5)],
                          ip_adapter=C.ImagePrompt(name="style", images=[png(8, 8)])), timeout=30)
    after = {a.name: a.requests for a in stub.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
    assert {name: after[name] - before[name] for name in after} == {"edges": 1, "depth": 0, "style": 1, "lora": 0}


def test_an_unset_size_takes_the_first_control_images(stub, fakes):
    stub.Generate(request(width=0, height=0, controls=[control(image=png(48, 32))], request_id="sized"), timeout=30)
    [item] = next(e for e in fakes.fakes["taking"].executes if e.items[0].request_id == "sized").items
    assert (item.width, item.height) == (48, 32) and item.controls[0].image.width == 48


@pytest.mark.parametrize("fields, field", [
    ({"controls": [control()] * 4}, "controls"),
    ({"controls": [control(conditioning_scale=2.5)]}, "controls[0].conditioning_scale"),
    ({"controls": [control(), control(conditioning_scale=float("nan"))]}, "controls[1].conditioning_scale"),
    ({"controls": [control(guidance_start=0.6, guidance_end=0.4)]}, "controls[0].guidance_start"),
    ({"controls": [control(guidance_end=1.5)]}, "controls[0].guidance_end"),
    ({"controls": [control(name="")]}, "controls[0].name"),
    ({"controls": [C.ControlInput(name="edges")]}, "controls[0].image"),
    ({"controls": [control(image=b"not an image")]}, "controls[0].image"),
    ({"controls": [control(image=png(32, 32))]}, "controls[0].image"),  # another size, no resize_mode
    ({"ip_adapter": C.ImagePrompt(name="style")}, "ip_adapter.images"),
    ({"ip_adapter": C.ImagePrompt(name="style", images=[png(8, 8)] * 5)}, "ip_adapter.images"),
    ({"ip_adapter": C.ImagePrompt(name="style", images=[png(8, 8)], scale=-1)}, "ip_adapter.scale"),
    ({"ip_adapter": C.ImagePrompt(name="style", images=[png(8, 8), b"\x89PNG broken"])}, "ip_adapter.images[1]"),
    ({"ip_adapter": C.ImagePrompt(name="style", images=[png(3000, 8)])}, "ip_adapter.images[0]"),  # > --max-size
])
def test_bad_controls_and_image_prompts_are_refused_naming_the_field(stub, fields, field):
    error = refusal(stub, request(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in field_violations(error), field_violations(error)


def test_a_stream_names_the_fields_under_request(stub):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(W.GenerateStreamRequest(request=request(
            controls=[control(conditioning_scale=3)])), timeout=30))
    assert "request.controls[0].conditioning_scale" in field_violations(caught.value)


@pytest.mark.parametrize("fields, field, words", [
    ({"controls": [control("nowhere")]}, "controls[0].name", "ControlNet 'nowhere' is not registered"),
    ({"ip_adapter": C.ImagePrompt(name="nowhere", images=[png(8, 8)])}, "ip_adapter.name",
     "IP-Adapter 'nowhere' is not registered"),
])
def test_a_name_not_registered_is_a_failed_precondition(stub, fields, field, words):
    error = refusal(stub, request(**fields))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert words in field_violations(error)[field]


@pytest.mark.parametrize("fields, field, words", [
    ({"controls": [control("lora")]}, "controls[0].name", "'lora' is registered as a LoRA, not as a ControlNet"),
    ({"controls": [control(), control("style")]}, "controls[1].name",
     "'style' is registered as an IP-Adapter, not as a ControlNet"),
    ({"ip_adapter": C.ImagePrompt(name="edges", images=[png(8, 8)])}, "ip_adapter.name",
     "'edges' is registered as a ControlNet, not as an IP-Adapter"),
    ({"ip_adapter": C.ImagePrompt(name="lora", images=[png(8, 8)])}, "ip_adapter.name",
     "'lora' is registered as a LoRA, not as an IP-Adapter"),
])
def test_a_name_registered_as_another_kind_is_invalid_argument_as_on_the_runner(stub, fields, field, words):
    """The request names something that is not of the field's kind: INVALID_ARGUMENT naming the
    field, the runner's words and status for it (``serving_common.conditioning_rules.wrong_kind``)."""
    error = refusal(stub, request(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field_violations(error)[field] == words


def test_a_controlnet_named_as_a_lora_is_refused(stub):
    error = refusal(stub, request(adapters=[C.AdapterRef(name="edges")]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name it in controls" in field_violations(error)["adapters[0].name"]


def test_a_family_that_takes_none_refuses_both(plain_stub):
    error = refusal(plain_stub, request(controls=[control()],
                                        ip_adapter=C.ImagePrompt(name="style", images=[png(8, 8)])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(error)
    assert "takes no ControlNets" in violations["controls"] and "takes no IP-Adapters" in violations["ip_adapter"]


def test_the_input_budget_counts_every_control_and_reference_image(stub):
    noise = png(200, 200, noise=True)  # about 120 kB: three do not fit --max-input-bytes
    assert 2 * len(noise) < MAX_INPUT_BYTES < 3 * len(noise)
    error = refusal(stub, request(controls=[control(image=noise)] * 2, resize_mode=W.RESIZE_MODE_RESIZE,
                                  ip_adapter=C.ImagePrompt(name="style", images=[noise])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-input-bytes" in error.details()
    stub.Generate(request(controls=[control(image=noise)], resize_mode=W.RESIZE_MODE_RESIZE,
                          ip_adapter=C.ImagePrompt(name="style", images=[noise])), timeout=30)


def test_unloading_ends_the_queued_requests_naming_it(stub, worker, fakes, adapter_dirs):
    """UnloadAdapter waits for the batch running (held by the fake's steps), then ends the request
    queued behind it that names the ControlNet, as it does for a LoRA."""
    stub.LoadAdapter(W.LoadAdapterRequest(name="brief", path=adapter_dirs["edges"], kind=CONTROLNET), timeout=30)
    fake = fakes.fakes["taking"]
    fake.steps_open = gate = asyncio.Event()
    running = Stream(stub, request(request_id="held"))
    wait_until(lambda: fake.busy_since is not None, 30, "the held request's first step")
    queued = Stream(stub, request(request_id="queued-control", controls=[control("brief")]))
    assert queued.wait_for("queued").queued.position == 0
    unload = stub.UnloadAdapter.future(W.UnloadAdapterRequest(name="brief"), timeout=60)
    wait_until(lambda: "adapter brief: unloading once" in worker.log(), 30, "UnloadAdapter waiting")
    stub.Cancel(W.CancelRequest(request_id="held"), timeout=10)
    fakes.loop.call_soon_threadsafe(gate.set)
    unload.result()
    queued.join()
    assert queued.error is not None and queued.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'brief' was unloaded after this request was accepted" in queued.error.details()
    running.join()
    fake.steps_open = None


def held_kinds(fake: FakeRunner) -> dict[str, int]:
    return {name: adapter.kind for name, adapter in fake.adapters.items()}


def test_a_restarted_runner_gets_each_adapter_back_with_its_kind(stub, fakes):
    expected = held_kinds(fakes.fakes["taking"])
    restarted = fakes.start("taking", [CONTROLNET, IP_ADAPTER])  # a new instance, holding nothing
    wait_until(lambda: held_kinds(restarted) == expected, 30, "the adapters re-applied")
    assert expected["edges"] == CONTROLNET and expected["style"] == IP_ADAPTER
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY, 30, "ready")
    stub.Generate(request(controls=[control()]), timeout=30)


def test_a_restarted_worker_restores_the_kinds_from_its_state_file(stub, worker, fakes, state_file, tmp_path):
    expected = held_kinds(fakes.fakes["taking"])
    worker.stop()
    fresh = fakes.start("taking", [CONTROLNET, IP_ADAPTER])
    again = start_worker(tmp_path, fakes.target("taking"), "--state-file", str(state_file))
    try:
        channel, restored = ready_stub(again)
        with channel:
            assert held_kinds(fresh) == expected
            listed = {a.name: a.kind for a in restored.ListAdapters(W.ListAdaptersRequest(), timeout=10).adapters}
            assert listed == expected
    finally:
        again.stop()
