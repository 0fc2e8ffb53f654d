"""Bring your own model (issue 38 items 2 to 4): single-file checkpoints in the original
A1111/ComfyUI layout, component overrides (a VAE swapped in) and LoRAs fused at load, through a
real worker and runner (started with ``--single-file-config tiny --single-file-config tiny-sdxl``),
and the runner's refusals and flag spellings on their own.

The single files are the tiny builds written in the original key layout by ``original_layout``
(the inverse of diffusers' own conversion), so loading one back must serve exactly the images of
the directory it came from."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import wait_until
from lora_files import make_lora
from original_layout import save_single_file
from runner_service.models.catalog import ensure_builtin
from serving_common.errors import field_violations
from support import pixels, request

W = worker_pb2
CONFIGS = ("--single-file-config", "tiny", "--single-file-config", "tiny-sdxl")


def _pipeline(name: str):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(ensure_builtin(name))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny builds as single files, a VAE that differs from tiny's, tiny with that VAE as a
    model directory, and a LoRA (two, for one per request on top)."""
    root = tmp_path_factory.mktemp("own-models")
    made = {name: save_single_file(_pipeline(name), root / f"{name}.safetensors") for name in ("tiny", "tiny-sdxl")}
    vae = _pipeline("tiny").vae
    with torch.no_grad():
        vae.decoder.conv_out.bias.add_(0.25)
    vae.save_pretrained(root / "vae")
    shutil.copytree(ensure_builtin("tiny"), root / "tiny-with-vae")
    shutil.rmtree(root / "tiny-with-vae" / "vae")
    shutil.copytree(root / "vae", root / "tiny-with-vae" / "vae")
    save_file({"foo.weight": torch.zeros(2)}, str(root / "unknown.safetensors"))
    return {**made, "vae": root / "vae", "tiny-with-vae": root / "tiny-with-vae",
            "unknown": root / "unknown.safetensors", "lora": make_lora(root / "lcm.safetensors", seed=3),
            "other": make_lora(root / "other.safetensors", seed=4, text_encoder=False)}


@pytest.fixture(scope="module")
def pair(serve):
    return serve(runner_args=CONFIGS)


def init(stub, model: str, overrides=(), fused=()) -> common_pb2.ModelInfo:
    reply = stub.Init(W.InitRequest(model=model, component_overrides=list(overrides), fused_adapters=list(fused)),
                      timeout=300)
    return reply.model


def image(stub, **fields):
    return pixels(stub.Generate(request(num_inference_steps=2, **fields), timeout=120))


def image_after_level_2_sleep(stub, tags: list[str] | None = None):
    """The image once a level-2 sleep (of ``tags``, else everything) discarded the weights and a
    wake read them back from where the model says they are."""
    stub.Sleep(W.SleepRequest(level=2, tags=tags or []), timeout=120)
    stub.WakeUp(W.WakeUpRequest(), timeout=300)
    return image(stub)


def refusal(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, **kwargs)
    return raised.value


def status_model(stub) -> common_pb2.ModelInfo:
    return stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.model


def serving_tiny(stub, overrides=(), fused=()) -> None:
    """Tiny with ``overrides`` and ``fused`` LoRAs (none: as built) is served: an Init, unless the
    runner holds just that already (no other override or fused LoRA, no adapter, nothing asleep, no
    weights loaded since). Each load costs the runner a second of CPU, and the pair starts serving tiny."""
    info = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info
    model = info.model
    if ((model.source, model.sleep_level) != ("tiny", 0) or list(model.component_overrides) != list(overrides)
            or list(model.fused_adapters) != list(fused) or info.adapters or info.weight_updates):
        init(stub, "tiny", overrides, fused)


@pytest.fixture(scope="module")
def tiny_image(stub) -> np.ndarray:
    """``image(stub)`` from tiny as built: the image the tests that change tiny compare with."""
    serving_tiny(stub)
    return image(stub)


def vae_override(files) -> common_pb2.ComponentOverride:
    return common_pb2.ComponentOverride(name="vae", source=str(files["vae"]))


def fused_lora(files) -> common_pb2.FusedAdapter:
    return common_pb2.FusedAdapter(source=str(files["lora"]), scale=0.5)


@pytest.fixture(scope="module")
def swapped_image(stub, files, tiny_image) -> np.ndarray:
    """``image(stub)`` from tiny with its VAE overridden (after ``tiny_image``, which loads tiny as built)."""
    serving_tiny(stub, overrides=[vae_override(files)])
    return image(stub)


# The two refusals first: each leaves tiny as it found it, so neither loads a model to start from.
@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_file_whose_family_cannot_be_told_is_refused_and_the_model_stays(stub, files):
    serving_tiny(stub)
    error = refusal(init, stub, str(files["unknown"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be told from its keys" in dict(field_violations(error))["source"]
    assert status_model(stub).source == "tiny"


@pytest.mark.process
@pytest.mark.timeout(300)
def test_an_override_that_does_not_fit_is_refused_before_the_model_is_unloaded(stub, files):
    serving_tiny(stub)
    weights_version = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.weights_version
    wrong_class = common_pb2.ComponentOverride(name="text_encoder",
                                               source=str(ensure_builtin("tiny-sdxl") / "text_encoder_2"))
    error = refusal(init, stub, "tiny", overrides=[wrong_class])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    why = dict(field_violations(error))["component_overrides[0].source"]
    assert "CLIPTextModelWithProjection" in why and "CLIPTextModel" in why
    unknown = common_pb2.ComponentOverride(name="refiner", source=str(files["vae"]))
    error = refusal(init, stub, "tiny", overrides=[unknown])
    assert "component_overrides[0].name" in dict(field_violations(error))
    twice = common_pb2.ComponentOverride(name="vae", source=str(files["vae"]))
    error = refusal(init, stub, "tiny", overrides=[twice, twice])
    assert "component_overrides[1].name" in dict(field_violations(error))
    model = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info
    assert model.model.source == "tiny" and model.weights_version == weights_version


@pytest.mark.process
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tiny", "tiny-sdxl"])
def test_a_single_file_serves_what_its_directory_serves(stub, files, tiny_image, name):
    if name == "tiny":
        own = tiny_image
    else:
        init(stub, name)
        own = image(stub)
    info = init(stub, str(files[name]))
    assert info.source == str(files[name])
    assert info.pipeline_class == {"tiny": "StableDiffusionPipeline", "tiny-sdxl": "StableDiffusionXLPipeline"}[name]
    assert (image(stub) == own).all()
    # A level-2 sleep discards the weights: waking reads them from the file again.
    assert (image_after_level_2_sleep(stub) == own).all()


@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_component_override_serves_like_a_model_holding_that_component(stub, files, tiny_image, swapped_image):
    base, swapped = tiny_image, swapped_image
    assert list(status_model(stub).component_overrides) == [vae_override(files)]
    # A level-2 sleep reads the VAE back from the override, not from the model's own folder.
    assert (image_after_level_2_sleep(stub, tags=["vae"]) == swapped).all()
    init(stub, str(files["tiny-with-vae"]))
    with_vae = image(stub)
    assert (swapped == with_vae).all() and not (swapped == base).all()


@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_fused_lora_stays_fused_through_a_level_2_sleep_with_adapters_on_top(stub, files, swapped_image):
    """On tiny with its VAE overridden (the state the restart test below starts from): fused, the
    LoRA changes that model's image."""
    fused_adapter = fused_lora(files)
    info = init(stub, "tiny", overrides=[vae_override(files)], fused=[fused_adapter])
    assert list(info.component_overrides) == [vae_override(files)] and list(info.fused_adapters) == [fused_adapter]
    fused = image(stub)
    assert not (fused == swapped_image).all()
    assert (image_after_level_2_sleep(stub) == fused).all()
    stub.LoadAdapter(W.LoadAdapterRequest(name="other", path=str(files["other"])), timeout=120)
    on_top = image(stub, adapters=[common_pb2.AdapterRef(name="other", scale=1.0)])
    assert not (on_top == fused).all()
    assert (image(stub) == fused).all()
    stub.UnloadAdapter(W.UnloadAdapterRequest(name="other"), timeout=60)


@pytest.mark.process
@pytest.mark.timeout(600)
def test_a_restarted_runner_loads_the_same_overrides_and_fused_loras(pair, stub, files):
    override, fused_adapter = vae_override(files), fused_lora(files)
    serving_tiny(stub, overrides=[override], fused=[fused_adapter])  # as the test before leaves it
    before = image(stub)
    first = stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.instance_id
    pair.restart_runner()
    wait_until(lambda: (runner := stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0]).ready
               and runner.info.instance_id != first, 120, "re-applied")
    model = status_model(stub)
    assert list(model.component_overrides) == [override] and list(model.fused_adapters) == [fused_adapter]
    assert (image(stub) == before).all()


@pytest.mark.unit
def test_the_flags_spell_overrides_and_fused_loras():
    from serving_common.config_flags import parse_config
    from serving_common.load_extras import parse_component, parse_fused
    from worker_service.config import WorkerConfig

    config = parse_config(WorkerConfig, ["--component", "vae=/models/vae", "--fuse-lora", "/loras/lcm.safetensors:0.8",
                                         "--fuse-lora", "org/lightning"], description="")
    assert config.component_overrides() == [common_pb2.ComponentOverride(name="vae", source="/models/vae")]
    assert config.fused_adapters() == [common_pb2.FusedAdapter(source="/loras/lcm.safetensors", scale=0.8),
                                       common_pb2.FusedAdapter(source="org/lightning")]
    assert not parse_fused("org/lightning@v2").HasField("scale")
    with pytest.raises(ValueError, match="NAME=SOURCE"):
        parse_component("vae")


@pytest.mark.unit
def test_a_file_of_a_known_family_without_its_config_is_refused_naming_where_it_looked(tmp_path):
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    from runner_service import single_file

    path = tmp_path / "sd15.safetensors"
    save_file({CHECKPOINT_KEY_NAMES["v1"]: torch.zeros(1), "model.diffusion_model.input_blocks.0.0.weight":
               torch.zeros(320, 4, 3, 3)}, str(path))

    def not_cached(repo: str) -> Path:
        raise LookupError(f"no {repo}")

    with pytest.raises(Exception) as raised:
        single_file.check(path, (), not_cached, not_cached)
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "Stable Diffusion 1.x" in raised.value.message and "stable-diffusion-v1-5" in raised.value.message
    found = single_file.check(path, (), not_cached, lambda repo: ensure_builtin("tiny"))
    assert found.pipeline_class == "StableDiffusionPipeline"
