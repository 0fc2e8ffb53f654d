"""ControlNets and IP-Adapters as callers set them (issue 39): the Python client's ``controls`` and
``ip_adapter`` (``Control``, ``ImagePrompt`` or dicts) and ``load_adapter(kind=...)``, the CLI's
``--control``, ``--ip-adapter`` and ``adapters load --kind``, and the HTTP API's ``extra_body``
through the real OpenAI SDK (generations in JSON, edits in multipart with JSON-valued fields).

The end-to-end tests run the real worker process (its HTTP port on) against an in-process fake
runner whose family takes both kinds: what each surface sent is read off the runner's Executes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from clients import Control, DiffusionClient, ImagePrompt, InvalidArgument, build_generate_request
from clients.cli import build_parser
from clients.cli_conditioning import conditioning_options
from conditioning_support import CONTROLNET, IP_ADAPTER, FakeRunners, png
from diffusion.v1 import common_pb2, runner_pb2
from harness.processes import ServiceProcess, free_port, start_worker
from serving_common.errors import ServiceError
from support import cli
from worker_service.http.params import parse_generation

# -- building requests (no worker) ---------------------------------------------------------------


@pytest.mark.unit
def test_the_client_builds_controls_and_an_image_prompt_from_objects_and_dicts():
    image = png(16, 16)
    request = build_generate_request("a fox", controls=[
        Control("edges", image, scale=0.8, start=0.1, end=0.9),
        {"name": "depth", "image": image, "conditioning_scale": 1.5}],
        ip_adapter={"name": "style", "images": image, "scale": 0.6})
    first, second = request.controls
    assert (first.name, first.image, first.conditioning_scale, first.guidance_start) == ("edges", image,
                                                                                         pytest.approx(0.8),
                                                                                         pytest.approx(0.1))
    assert second.name == "depth" and not second.HasField("guidance_end")  # unset: the worker's default
    assert request.ip_adapter.name == "style" and list(request.ip_adapter.images) == [image]
    assert not build_generate_request("a fox").HasField("ip_adapter")


@pytest.mark.unit
@pytest.mark.parametrize("options, field", [
    ({"controls": [Control("edges", b"x")] * 4}, "controls"),
    ({"controls": [Control("edges", b"x", scale=2.5)]}, "controls[0].conditioning_scale"),
    ({"controls": [Control("edges", b"x", start=0.5, end=0.5)]}, "controls[0].guidance_start"),
    ({"ip_adapter": ImagePrompt("style", [b"x"] * 5)}, "ip_adapter.images"),
    ({"ip_adapter": ImagePrompt("style", b"x", scale=float("inf"))}, "ip_adapter.scale"),
])
def test_the_client_refuses_what_every_worker_refuses_naming_the_field(options, field):
    with pytest.raises(InvalidArgument) as caught:
        build_generate_request("a fox", **options)
    assert field in caught.value.violations


@pytest.mark.unit
def test_the_cli_reads_controls_and_reference_images(tmp_path):
    for name in ("e.png", "a.png", "b.png"):
        (tmp_path / name).write_bytes(name.encode())
    args = build_parser().parse_args([
        "generate", "a fox", "-o", "x.png", "--control", f"edges={tmp_path / 'e.png'}:0.8",
        "--control", f"depth={tmp_path / 'e.png'}", "--ip-adapter", f"style={tmp_path / 'a.png'},{tmp_path / 'b.png'}",
        "--ip-adapter", f"style={tmp_path / 'e.png'}:0.5"])
    options = conditioning_options(args.control, args.ip_adapter)
    assert options["controls"] == [Control("edges", b"e.png", 0.8), Control("depth", b"e.png", None)]
    assert options["ip_adapter"] == ImagePrompt("style", [b"a.png", b"b.png", b"e.png"], 0.5)


@pytest.mark.unit
@pytest.mark.parametrize("flags, words", [
    (["--control", "edges"], "NAME=IMAGE[:SCALE]"),
    (["--control", "edges=missing.png"], "cannot read"),
    (["--ip-adapter", "style=IMG", "--ip-adapter", "other=IMG"], "a request takes one IP-Adapter"),
])
def test_the_cli_refuses_bad_conditioning_flags_as_usage_errors(flags, words, tmp_path):
    (tmp_path / "i.png").write_bytes(b"i")
    flags = [flag.replace("IMG", str(tmp_path / "i.png")) for flag in flags]
    done = cli("--target", "127.0.0.1:1", "generate", "a fox", "-o", str(tmp_path / "x.png"), *flags)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.unit
def test_the_http_body_takes_base64_and_data_urls():
    image = png(8, 8)
    parsed = parse_generation({"prompt": "a fox", "controls": [
        {"name": "edges", "image": b64(image), "conditioning_scale": 0.5, "guidance_end": 0.75},
        {"name": "depth", "image": f"data:image/png;base64,{b64(image)}"}],
        "ip_adapter": {"name": "style", "images": [b64(image)], "scale": 0.3}}).request
    assert [c.image for c in parsed.controls] == [image, image]
    assert parsed.controls[0].guidance_end == 0.75 and not parsed.controls[1].HasField("conditioning_scale")
    assert parsed.ip_adapter.images == [image] and parsed.ip_adapter.scale == pytest.approx(0.3)


@pytest.mark.unit
@pytest.mark.parametrize("body, field", [
    ({"controls": {"name": "edges"}}, "controls"),
    ({"controls": [{"name": "edges", "image": "x"}] * 4}, "controls"),
    ({"controls": [{"name": "edges", "image": "not base64!"}]}, "controls[0].image"),
    ({"controls": [{"image": "AAAA"}]}, "controls[0].name"),
    ({"controls": [{"name": "edges", "image": "AAAA", "conditioning_scale": "high"}]},
     "controls[0].conditioning_scale"),
    ({"controls": [{"name": "edges", "image": "AAAA", "weight": 1}]}, "controls[0].weight"),
    ({"ip_adapter": {"name": "style", "images": "AAAA"}}, "ip_adapter.images"),
    ({"ip_adapter": {"name": "style", "images": ["AAAA"] * 5}}, "ip_adapter.images"),
    ({"ip_adapter": {"name": "style", "images": ["AAAA"], "scale": True}}, "ip_adapter.scale"),
])
def test_the_http_body_refuses_bad_conditioning_naming_the_field(body, field):
    with pytest.raises(ServiceError) as caught:
        parse_generation({"prompt": "a fox", **body})
    assert field in dict(caught.value.violations)


# -- end to end, against a fake runner -----------------------------------------------------------


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeRunners]:
    runners = FakeRunners(tmp_path_factory.mktemp("surface-fakes"))
    runners.start("taking", [CONTROLNET, IP_ADAPTER])
    yield runners
    runners.close()


@pytest.fixture(scope="module")
def worker(fakes: FakeRunners, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    port = free_port()
    process = start_worker(tmp_path_factory.mktemp("surface-worker"), fakes.target("taking"), "--model", "fake-sd",
                           "--http-port", str(port))
    process.extra["base_url"] = f"http://127.0.0.1:{port}/v1"
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(worker: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiffusionClient]:
    """A client whose worker has ControlNet edges and IP-Adapter style registered, by the client."""
    root = tmp_path_factory.mktemp("surface-adapters")
    with DiffusionClient(worker.target, timeout=30) as client:
        client.wait_ready()
        for name, kind in (("edges", "controlnet"), ("style", "ip_adapter")):
            (root / name).mkdir()
            assert client.load_adapter(name, root / name, kind=kind).kind == (CONTROLNET if name == "edges"
                                                                               else IP_ADAPTER)
        yield client


def executed(fakes: FakeRunners, request_id: str) -> runner_pb2.ExecuteItem:
    """The item the runner got for ``request_id``."""
    return next(item for execute in fakes.fakes["taking"].executes for item in execute.items
                if item.request_id == request_id)


@pytest.mark.process
def test_the_python_client_sends_controls_and_an_image_prompt(client, fakes):
    result = client.generate("a fox", width=64, height=64, steps=2, request_id="python-client",
                             controls=[Control("edges", png(64, 64), scale=0.4)],
                             ip_adapter=ImagePrompt("style", [png(16, 16), png(24, 24)]))
    assert len(result.images) == 1
    item = executed(fakes, "python-client")
    assert item.controls[0].conditioning_scale == pytest.approx(0.4) and item.controls[0].image.width == 64
    assert [image.width for image in item.ip_adapter.images] == [16, 24] and item.ip_adapter.scale == 1.0


@pytest.mark.process
def test_the_cli_loads_by_kind_lists_it_and_generates_with_both(client, worker, fakes, tmp_path):
    (tmp_path / "depth").mkdir()
    loaded = cli("--target", worker.target, "adapters", "load", "depth", str(tmp_path / "depth"), "--kind",
                 "controlnet")
    assert loaded.returncode == 0 and loaded.stdout.startswith("loaded controlnet depth"), loaded.stderr
    rows = [line.split()[:2] for line in cli("--target", worker.target, "adapters", "list").stdout.splitlines()[1:-1]]
    assert ["depth", "controlnet"] in rows and ["style", "ip_adapter"] in rows
    (tmp_path / "edges.png").write_bytes(png(32, 32))
    (tmp_path / "ref.png").write_bytes(png(16, 16))
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "fox.png"), "--size", "64x64",
               "--steps", "2", "--resize", "resize", "--control", f"edges={tmp_path / 'edges.png'}:0.7",
               "--control", f"depth={tmp_path / 'edges.png'}", "--ip-adapter", f"style={tmp_path / 'ref.png'}:0.5")
    assert done.returncode == 0, done.stderr
    item = executed(fakes, fakes.fakes["taking"].executes[-1].items[0].request_id)
    assert [(c.name, round(c.conditioning_scale, 3)) for c in item.controls] == [("edges", 0.7), ("depth", 1.0)]
    assert item.ip_adapter.name == "style" and item.ip_adapter.scale == pytest.approx(0.5)
    refused = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "no.png"),
                  "--control", f"nowhere={tmp_path / 'edges.png'}")
    assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr
    assert "controls[0].name" in refused.stderr


def sdk(worker: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.extra["base_url"], api_key="unused", max_retries=0, timeout=60)


@pytest.mark.process
def test_the_openai_sdk_sends_them_in_extra_body(client, worker, fakes):
    images = sdk(worker).images.generate(prompt="a fox", size="64x64", extra_body={
        "num_inference_steps": 2, "seed": 5,
        "controls": [{"name": "edges", "image": b64(png(64, 64)), "conditioning_scale": 0.3, "guidance_start": 0.25}],
        "ip_adapter": {"name": "style", "images": [f"data:image/png;base64,{b64(png(8, 8))}"], "scale": 0.9}})
    assert len(images.data) == 1 and images.data[0].b64_json
    item = fakes.fakes["taking"].executes[-1].items[0]
    assert (item.controls[0].name, item.controls[0].guidance_start) == ("edges", pytest.approx(0.25))
    assert item.ip_adapter.images[0].width == 8 and item.ip_adapter.scale == pytest.approx(0.9)


@pytest.mark.process
@pytest.mark.parametrize("extra, param, words", [
    ({"controls": [{"name": "edges", "image": "%%%"}]}, "controls[0].image", "base64"),
    ({"controls": [{"name": "edges", "image": b64(png(64, 64)), "conditioning_scale": 5}]},
     "controls[0].conditioning_scale", "from 0 to 2"),
    ({"controls": [{"name": "nowhere", "image": b64(png(64, 64))}]}, "controls[0].name", "not registered"),
    ({"ip_adapter": {"name": "style", "images": []}}, "ip_adapter.images", "1 to 4"),
])
def test_the_openai_sdk_gets_a_400_naming_the_field(client, worker, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(worker).images.generate(prompt="a fox", size="64x64", extra_body={"num_inference_steps": 2, **extra})
    error: Any = caught.value.body
    assert error["param"] == param and words in error["message"], error


@pytest.mark.process
def test_an_edit_takes_them_as_json_valued_form_fields(client, worker, fakes, tmp_path):
    source = tmp_path / "source.png"
    source.write_bytes(png(64, 64))
    controls = [{"name": "edges", "image": b64(png(64, 64)), "conditioning_scale": 0.6}]
    with source.open("rb") as image:
        edited = sdk(worker).images.edit(image=image, prompt="a fox at dusk", size="64x64", extra_body={
            "num_inference_steps": 2, "strength": 0.5, "controls": json.dumps(controls),
            "ip_adapter": json.dumps({"name": "style", "images": [b64(png(8, 8))]})})
    assert len(edited.data) == 1
    item = fakes.fakes["taking"].executes[-1].items[0]
    assert item.task == common_pb2.TASK_IMAGE_TO_IMAGE and item.controls[0].conditioning_scale == pytest.approx(0.6)
    assert item.ip_adapter.name == "style"
    with source.open("rb") as image, pytest.raises(openai.BadRequestError) as caught:
        sdk(worker).images.edit(image=image, prompt="a fox", size="64x64", extra_body={"controls": "[{"})
    assert caught.value.body["param"] == "controls"  # type: ignore[index]


@pytest.mark.process
def test_a_registration_of_an_unknown_kind_is_refused(client):
    with pytest.raises(InvalidArgument) as caught:
        client.load_adapter("odd", "/tmp", kind=7)
    assert "kind" in caught.value.violations
    assert "odd" not in {a.name for a in client.list_adapters().adapters}
