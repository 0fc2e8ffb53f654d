"""IP-Adapters per request on the runner (issue 39 item 3): the built-in ``tiny-ip-adapter`` and
``tiny-sdxl-ip-adapter`` (diffusers' test configs, seeded weights) registered by name through the
runner's LoadAdapter (kind IP_ADAPTER), and a request's image prompt making the image diffusers' own
pipeline makes with the adapter loaded (``load_ip_adapter``), the same scale and seed, within 1/255:
alone, in a step batch beside a plain request and one at another scale and reference image (each
equal to its image alone, the plain one to the plain pipeline's), and through the request-level
pipeline call. Refusals: an unregistered name (FAILED_PRECONDITION naming ``ip_adapter.name``), a
LoRA's or a ControlNet's name (INVALID_ARGUMENT, as is an IP-Adapter's name in ``controls``),
another family's adapter (INVALID_ARGUMENT naming ``path``, the model unchanged). A level-2 sleep
takes the adapters off the UNet and the next image prompt after the wake-up loads them again. Served
by a real runner process: capabilities, LoadAdapter, GetInfo, Execute and UnloadAdapter."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from safetensors.torch import load_file, save_file

from diffusion.v1 import common_pb2, runner_pb2
from lora_files import make_lora
from runner_calls import execute, info, item, pixels
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.device_gate import CallWatch
from runner_service.execution import BatchResult, StepProgress, run_checked
from runner_service.ip_adapters import ENCODER_FOLDER, WEIGHTS_FILE
from runner_service.models.build import BUILT_IP_ADAPTER_NAMES
from runner_service.models.catalog import ensure_builtin
from runner_service.models.controlnets import save_controlnet
from runner_service.models.tiny_ip_adapters import BUILT_IP_ADAPTERS, save_ip_adapter
from runner_service.overrun import Abandonment
from serving_common.errors import ServiceError

pytestmark = pytest.mark.process

SIZE = 64
STEPS = 3
GUIDANCE = 5.0
ADAPTERS = {"tiny": "tiny-ip-adapter", "tiny-sdxl": "tiny-sdxl-ip-adapter"}


def reference_image(seed: int, width: int = 40, height: int = 50) -> Image.Image:
    """A random reference image at its own size (the encoder's feature extractor resizes it)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def raw(image: Image.Image) -> runner_pb2.RawImage:
    return runner_pb2.RawImage(width=image.width, height=image.height, channels=3, pixels=image.tobytes())


def prompted(seed: int, name: str, scale: float, *images: Image.Image, **fields: Any) -> runner_pb2.ExecuteItem:
    """A guided text-to-image item with an image prompt (none when ``name`` is empty)."""
    execute_item = item(seed=seed, steps=STEPS, size=SIZE, guidance_scale=GUIDANCE, **fields)
    if name:
        execute_item.ip_adapter.CopyFrom(runner_pb2.ExecuteImagePrompt(name=name, images=[raw(i) for i in images],
                                                                       scale=scale))
    return execute_item


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def uint8(images: np.ndarray) -> np.ndarray:
    return np.asarray((images * 255).round().clip(0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each built-in IP-Adapter written by ``save_ip_adapter`` (as ``diffusion-build-model`` writes it)."""
    base = tmp_path_factory.mktemp("ip-adapters")
    return {name: save_ip_adapter(name, base / name) for name in BUILT_IP_ADAPTERS}


def diffusers_image(model: str, adapter: Path | None, scale: float, seed: int,
                    images: tuple[Image.Image, ...] = ()) -> np.ndarray:
    """What diffusers' own pipeline makes with the adapter loaded (``load_ip_adapter``) at ``scale``,
    or plain without one."""
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(model, None), torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    extra: dict[str, Any] = {}
    if adapter is not None:
        pipeline.load_ip_adapter(str(adapter), subfolder="", weight_name=WEIGHTS_FILE)
        pipeline.set_ip_adapter_scale(scale)
        extra["ip_adapter_image"] = [list(images)]  # one entry per IP-Adapter: its reference images
    with torch.inference_mode():
        made = pipeline(prompt=["a red fox"], negative_prompt=[""], num_inference_steps=STEPS,
                        guidance_scale=GUIDANCE, generator=[torch.Generator("cpu").manual_seed(seed)], width=SIZE,
                        height=SIZE, output_type="np", **extra).images
    return uint8(made)[0]


async def served(events: Any) -> BatchResult:
    async for event in events:
        if not isinstance(event, StepProgress):
            return event
    raise AssertionError("no result")


def run(host: ModelHost, *items: runner_pb2.ExecuteItem) -> list[np.ndarray]:
    """Each item's image through the step engine, all submitted at once (they share its steps)."""
    async def together() -> list[BatchResult]:
        return list(await asyncio.gather(*(served(host.execute([one], False)) for one in items)))

    return [result.outputs[0].pixels for result in asyncio.run(together())]


def register(host: ModelHost, name: str, path: Path) -> Any:
    return load(host, common_pb2.ADAPTER_KIND_IP_ADAPTER, name, path)


def load(host: ModelHost, kind: int, name: str, path: Path) -> Any:
    """Registers the adapter of ``kind`` at ``path`` as the runner's LoadAdapter does."""
    return asyncio.run(host.load_adapter(kind, name, str(path), False, "", CallWatch("LoadAdapter")))


@pytest.fixture(scope="module")
def hosts(cpu_platform: Any, adapter_dirs: dict[str, Path]) -> Callable[[str], ModelHost]:
    """A runner's host in this process per model (float32 on the CPU, loaded as LoadModel loads it)
    with its built-in IP-Adapter registered as "style", made on first use."""
    made: dict[str, ModelHost] = {}

    def host(model: str) -> ModelHost:
        if model not in made:
            made[model] = ModelHost(cpu_platform, RunnerConfig())
            asyncio.run(made[model].load(model, None))
            register(made[model], "style", adapter_dirs[ADAPTERS[model]])
        return made[model]

    return host


def test_the_built_in_ip_adapters_are_named_for_the_build_command() -> None:
    assert BUILT_IP_ADAPTER_NAMES == tuple(BUILT_IP_ADAPTERS)


@pytest.mark.parametrize("model", list(ADAPTERS))
def test_an_image_prompt_equals_diffusers_alone_and_in_a_step_batch(model: str, hosts: Callable[[str], ModelHost],
                                                                    adapter_dirs: dict[str, Path]) -> None:
    """Alone, and in one step batch with a plain request, one at another scale and reference image
    and one of two reference images: each image equals diffusers' pipeline with the adapter loaded at
    its scale (the plain one, the plain pipeline's). The first three share each UNet call; the one of
    two images takes a call of its own (the adapter attends over every image's tokens at once)."""
    host = hosts(model)
    fox, square = reference_image(1), reference_image(2, 30, 24)
    first, plain, second, pair = (prompted(21, "style", 0.8, fox), prompted(22, "", 0.0),
                                  prompted(23, "style", 1.5, square), prompted(24, "style", 1.0, fox, square))
    alone = run(host, first)[0]
    unet = host.slot.require().pipeline.unet
    widths: list[int] = []
    hook = unet.register_forward_pre_hook(lambda module, args: widths.append(int(args[0].shape[0])))
    try:
        batch = run(host, first, plain, second, pair)
    finally:
        hook.remove()
    adapter = adapter_dirs[ADAPTERS[model]]
    assert difference(alone, diffusers_image(model, adapter, 0.8, 21, (fox,))) <= 1
    assert difference(batch[0], alone) <= 1
    assert difference(batch[1], diffusers_image(model, None, 0.0, 22)) <= 1
    assert difference(batch[2], diffusers_image(model, adapter, 1.5, 23, (square,))) <= 1
    assert difference(batch[3], diffusers_image(model, adapter, 1.0, 24, (fox, square))) <= 1
    assert difference(batch[0], batch[1]) > 8  # the image prompt changes the image
    assert sorted(set(widths)) == [2, 6]  # three guided sequences' rows in one UNet call, the pair's apart


def test_the_request_level_pipeline_call_equals_diffusers(hosts: Callable[[str], ModelHost],
                                                          adapter_dirs: dict[str, Path]) -> None:
    """The pipeline call (request-level batching) passes each image's embeddings and the scale."""
    model = hosts("tiny").slot.require()
    fox = reference_image(3)
    outputs = run_checked(model, [prompted(31, "style", 1.2, fox)], hosts("tiny").limits, lambda _: None,
                          Abandonment()).outputs
    assert difference(outputs[0].pixels, diffusers_image("tiny", adapter_dirs["tiny-ip-adapter"], 1.2, 31, (fox,))) <= 1
    plain = run_checked(model, [prompted(32, "", 0.0)], hosts("tiny").limits, lambda _: None, Abandonment()).outputs
    assert difference(plain[0].pixels, diffusers_image("tiny", None, 0.0, 32)) <= 1


def test_requests_naming_no_ip_adapter_of_the_model_are_refused(hosts: Callable[[str], ModelHost],
                                                                tmp_path: Path) -> None:
    """An unregistered name is FAILED_PRECONDITION naming ``ip_adapter.name``; a LoRA's name and a
    scale out of [0, 2] are INVALID_ARGUMENT naming the field."""
    host = hosts("tiny")
    with pytest.raises(ServiceError) as missing:
        host.check_batch([prompted(1, "absent", 1.0, reference_image(1))])
    assert missing.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "ip_adapter.name" in missing.value.message and "'absent' is not registered" in missing.value.message
    load(host, common_pb2.ADAPTER_KIND_LORA, "a-lora", make_lora(tmp_path / "lora.safetensors", 3))
    try:
        with pytest.raises(ServiceError) as lora:
            host.check_batch([prompted(1, "a-lora", 1.0, reference_image(1))])
        with pytest.raises(ServiceError) as taken:
            register(host, "a-lora", host.slot.require().ip_adapters.registered["style"].path)
    finally:
        asyncio.run(host.unload_adapter("a-lora", CallWatch("UnloadAdapter")))
    assert lora.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(lora.value.violations)["items[0].ip_adapter.name"] == (
        "'a-lora' is registered as a LoRA, not as an IP-Adapter")
    assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ServiceError) as scale:
        host.check_batch([prompted(1, "style", 2.5, reference_image(1))])
    assert scale.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].ip_adapter.scale" in dict(scale.value.violations)


def test_a_name_of_another_kind_is_invalid_argument_in_each_field_and_taken_for_each_kind(
        hosts: Callable[[str], ModelHost], tmp_path: Path) -> None:
    """A ControlNet's name as the image prompt's IP-Adapter and an IP-Adapter's as a ControlNet are
    INVALID_ARGUMENT naming the field, as the worker refuses them (the former was FAILED_PRECONDITION
    here: a name not registered as an IP-Adapter). A name one kind holds is ALREADY_EXISTS for the
    others, naming the kind it is registered as; UnloadAdapter finds it in its kind's store."""
    host = hosts("tiny")
    load(host, common_pb2.ADAPTER_KIND_CONTROLNET, "edges", save_controlnet("tiny-controlnet", tmp_path / "edges"))
    try:
        with pytest.raises(ServiceError) as controlnet:
            host.check_batch([prompted(1, "edges", 1.0, reference_image(1))])
        as_control = prompted(1, "", 0.0)
        as_control.controls.add(name="style", image=raw(Image.new("RGB", (SIZE, SIZE))), conditioning_scale=1.0,
                                guidance_end=1.0)
        with pytest.raises(ServiceError) as ip_adapter:
            host.check_batch([as_control])
        with pytest.raises(ServiceError) as taken:
            load(host, common_pb2.ADAPTER_KIND_LORA, "edges", tmp_path / "edges")
        assert "edges" in host.slot.require().controlnets.registered
    finally:
        asyncio.run(host.unload_adapter("edges", CallWatch("UnloadAdapter")))
    assert controlnet.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(controlnet.value.violations)["items[0].ip_adapter.name"] == (
        "'edges' is registered as a ControlNet, not as an IP-Adapter")
    assert ip_adapter.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(ip_adapter.value.violations)["items[0].controls[0].name"] == (
        "'style' is registered as an IP-Adapter, not as a ControlNet")
    assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS and "registered as a ControlNet" in taken.value.message
    assert "edges" not in host.slot.require().controlnets.registered
    with pytest.raises(ServiceError) as gone:
        asyncio.run(host.unload_adapter("edges", CallWatch("UnloadAdapter")))
    assert gone.value.code == grpc.StatusCode.NOT_FOUND


def test_another_familys_ip_adapter_is_refused_naming_path_and_changes_nothing(
        hosts: Callable[[str], ModelHost], adapter_dirs: dict[str, Path]) -> None:
    host = hosts("tiny")
    before = run(host, prompted(41, "style", 1.0, reference_image(4)))[0]
    with pytest.raises(ServiceError) as refused:
        register(host, "xl", adapter_dirs["tiny-sdxl-ip-adapter"])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "path" in dict(refused.value.violations)
    assert list(host.slot.require().ip_adapters.registered) == ["style"]
    assert difference(run(host, prompted(41, "style", 1.0, reference_image(4)))[0], before) == 0


def test_a_level_2_sleep_frees_the_ip_adapters_and_the_next_image_prompt_loads_them(
        hosts: Callable[[str], ModelHost]) -> None:
    host = hosts("tiny")
    model = host.slot.require()
    wanted = prompted(51, "style", 0.7, reference_image(5))
    before = run(host, wanted)[0]
    adapter = model.ip_adapters.registered["style"]
    assert adapter.resident and adapter.parameter_bytes > 0 and len(adapter.digest) == 64
    asyncio.run(host.sleep(2, [], CallWatch("Sleep")))
    assert not adapter.resident and model.pipeline.unet.encoder_hid_proj is None
    asyncio.run(host.wake([], CallWatch("WakeUp")))
    assert difference(run(host, wanted)[0], before) == 0 and adapter.resident


def variant(source: Path, target: Path, seed: int, encoder: bool = False) -> Path:
    """A copy of an IP-Adapter directory with other seeded weights: its adapter's, or its image encoder's."""
    shutil.copytree(source, target)
    file = target / (f"{ENCODER_FOLDER}/model.safetensors" if encoder else WEIGHTS_FILE)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(tensor.shape, generator=generator) * tensor.std()
               for name, tensor in load_file(file).items()}
    save_file(tensors, file)
    return target


def test_rows_of_two_ip_adapters_share_a_unet_call_each_equal_to_diffusers(
        hosts: Callable[[str], ModelHost], adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A second IP-Adapter (of the same image encoder) registered beside "style": both are on the UNet
    at once, a row of each shares one UNet call, and each image equals diffusers' pipeline with its
    adapter alone loaded. One of another image encoder is FAILED_PRECONDITION, nothing changed."""
    host = hosts("tiny")
    second = variant(adapter_dirs["tiny-ip-adapter"], tmp_path / "second", 5)
    register(host, "second", second)
    try:
        with pytest.raises(ServiceError) as encoder:
            register(host, "third", variant(adapter_dirs["tiny-ip-adapter"], tmp_path / "third", 6, encoder=True))
        fox, square = reference_image(7), reference_image(8)
        unet = host.slot.require().pipeline.unet
        widths: list[int] = []
        hook = unet.register_forward_pre_hook(lambda module, args: widths.append(int(args[0].shape[0])))
        try:
            styled, seconded = run(host, prompted(71, "style", 0.9, fox), prompted(72, "second", 1.3, square))
        finally:
            hook.remove()
    finally:
        asyncio.run(host.unload_adapter("second", CallWatch("UnloadAdapter")))
    assert encoder.value.code == grpc.StatusCode.FAILED_PRECONDITION and "image encoder" in encoder.value.message
    assert set(widths) == {4}  # both guided sequences in every call
    assert difference(styled, diffusers_image("tiny", adapter_dirs["tiny-ip-adapter"], 0.9, 71, (fox,))) <= 1
    assert difference(seconded, diffusers_image("tiny", second, 1.3, 72, (square,))) <= 1
    assert list(host.slot.require().ip_adapters.registered) == ["style"]


def test_a_served_runner_registers_executes_lists_and_unloads_an_ip_adapter(
        shared_runner: Any, adapter_dirs: dict[str, Path]) -> None:
    stub = shared_runner.load("tiny")
    capabilities = info(stub).model.capabilities
    assert common_pb2.ADAPTER_KIND_IP_ADAPTER in capabilities.adapter_kinds
    loaded = stub.LoadAdapter(runner_pb2.RunnerServiceLoadAdapterRequest(
        name="style", path=str(adapter_dirs["tiny-ip-adapter"]), kind=common_pb2.ADAPTER_KIND_IP_ADAPTER), timeout=60)
    assert loaded.adapter.kind == common_pb2.ADAPTER_KIND_IP_ADAPTER and loaded.adapter.parameter_bytes > 0
    try:
        fox = reference_image(6)
        image = pixels(execute(stub, prompted(61, "style", 0.9, fox))[1])
        assert difference(image, diffusers_image("tiny", adapter_dirs["tiny-ip-adapter"], 0.9, 61, (fox,))) <= 1
        listed = {adapter.name: adapter for adapter in info(stub).adapters}
        assert listed["style"].kind == common_pb2.ADAPTER_KIND_IP_ADAPTER and listed["style"].resident
    finally:
        stub.UnloadAdapter(runner_pb2.RunnerServiceUnloadAdapterRequest(name="style"), timeout=60)
    with pytest.raises(grpc.RpcError) as gone:
        execute(stub, prompted(61, "style", 0.9, reference_image(6)))
    assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ip_adapter.name" in gone.value.details()


def test_the_adapter_directory_is_what_load_ip_adapter_reads(adapter_dirs: dict[str, Path]) -> None:
    for directory in adapter_dirs.values():
        assert (directory / WEIGHTS_FILE).is_file() and (directory / ENCODER_FOLDER / "config.json").is_file()
