"""The built-in models: the trained ``shapes``, shipped in the package, and those built from configs;
all in diffusers format, loaded by any diffusers code."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile

import grpc
import pytest
import torch
from diffusers import DiffusionPipeline

from diffusion.v1 import runner_pb2
from harness.forked_python import run_module
from harness.processes import REPO
from runner_calls import execute, generate, item, pixels, refused, runner_stub
from runner_service.models.catalog import ensure_builtin
from runner_service.models.controlnets import save_controlnet
from runner_service.models.shapes_scenes import Scene, read_back
from runner_service.models.tiny_ip_adapters import save_ip_adapter
from runner_service.models.train_shapes import Recipe, train
from serving_common.errors import field_violations
from serving_common.protocol import BUILTIN_MODEL_NAMES
from worker_service.main import parse_args as parse_worker_args

pytestmark = pytest.mark.process


def digests(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*.safetensors"))}


def build_model(name: str, directory) -> subprocess.CompletedProcess[str]:
    """``diffusion-build-model name directory`` run to its end, as a process of its own forked from
    the runner's zygote (``harness.forked_python``): its imports are done, not its work."""
    return run_module("runner_service.models.build", [name, str(directory)])


def test_build_model_writes_a_loadable_pipeline_with_the_same_bytes_every_time_and_never_overwrites(
        tmp_path, family_directory):
    """``tiny`` is the ``sd`` family's build: the one this test process made has the same bytes."""
    build_model("tiny", tmp_path / "tiny").check_returncode()
    assert digests(tmp_path / "tiny") == digests(family_directory("sd")) != {}
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "tiny")
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(pipeline.components)
    again = build_model("tiny", tmp_path / "tiny")
    assert again.returncode != 0 and "already holds a model" in again.stderr


@pytest.mark.parametrize("name, pipeline_class", [("tiny-sdxl", "StableDiffusionXLPipeline"),
                                                  ("tiny-sd3", "StableDiffusion3Pipeline"),
                                                  ("tiny-flux", "FluxPipeline")])
def test_modern_family_built_ins_load_by_name_and_generate(shared_runner, name, pipeline_class):
    stub = runner_stub(shared_runner.target)
    model = stub.LoadModel(runner_pb2.LoadModelRequest(source=name), timeout=300).info.model
    assert (model.source, model.pipeline_class) == (name, pipeline_class)
    assert generate(stub, steps=2, size=16).shape == (16, 16, 3)
    if name == "tiny-flux":  # the runner holds its own bounds too: a negative prompt needs true CFG above 1
        assert model.capabilities.true_cfg and model.capabilities.default_true_cfg_scale == 1
        error = refused(lambda request, **options: list(stub.Execute(request, **options)),
                        runner_pb2.ExecuteRequest(items=[item(size=16, negative_prompt="blurry")]), timeout=60)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "items[0].negative_prompt" in field_violations(error)
        guided = execute(stub, item(size=16, steps=2, negative_prompt="blurry", true_cfg_scale=4))[1]
        assert pixels(guided).shape == (16, 16, 3)


def test_build_model_writes_a_modern_family_by_name_as_the_family_builds_it(tmp_path, family_directory):
    built = build_model("tiny-flux", tmp_path / "f")
    built.check_returncode()
    assert built.stdout.strip() == str(tmp_path / "f")
    assert type(DiffusionPipeline.from_pretrained(tmp_path / "f")).__name__ == "FluxPipeline"
    assert digests(tmp_path / "f") == digests(family_directory("flux"))


@pytest.mark.parametrize("name, save", [("tiny-controlnet", save_controlnet), ("tiny-ip-adapter", save_ip_adapter)])
def test_a_controlnet_or_ip_adapter_another_writer_put_in_place_first_is_taken_as_written(tmp_path, name, save):
    """The catalog writes into a staging directory renamed into place; where another writer (another
    process building the same directory) got there first, the rename fails and the directory is
    taken as written when it is complete by its kind's files: a ControlNet's config and weights, an
    IP-Adapter's weights and image encoder (only a pipeline has a model_index.json). A directory of
    anything else there is still an error, left as it was."""
    target = tmp_path / name
    assert save(name, target) == target
    written = digests(target)
    assert save(name, target) == target and digests(target) == written != {}
    assert [path.name for path in tmp_path.iterdir()] == [name]  # no staging directory left behind
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("someone's")
    with pytest.raises(OSError):
        save(name, other)
    assert [path.name for path in other.iterdir()] == ["notes.txt"]


def test_shapes_is_the_default_and_the_runner_loads_it_from_the_package_and_it_draws_the_prompt(shared_runner):
    """No build: ``shapes`` is the package's own directory, loaded through from_pretrained like any other."""
    assert BUILTIN_MODEL_NAMES[0] == "shapes" == parse_worker_args([])[0].model
    directory = ensure_builtin("shapes")
    assert directory == REPO / "runner_service" / "models" / "shapes" and (directory / "model_index.json").is_file()
    stub = runner_stub(shared_runner.target)
    model = stub.LoadModel(runner_pb2.LoadModelRequest(source="shapes"), timeout=300).info.model
    assert (model.source, model.pipeline_class) == ("shapes", "FluxPipeline")
    scene = Scene("red", "circle", "blue")
    image = pixels(execute(stub, item(prompt=scene.prompt, steps=20, size=64, seed=1))[1])
    matches = read_back(image).matches(scene)  # every property, on many prompts: test_shapes_adherence
    assert image.shape == (64, 64, 3) and matches["colour"] and matches["background"], read_back(image)


def test_build_model_copies_shapes_as_shipped(tmp_path):
    build_model("shapes", tmp_path / "shapes").check_returncode()
    assert digests(tmp_path / "shapes") == digests(ensure_builtin("shapes")) != {}


@pytest.mark.slow
def test_a_wheel_carries_every_file_of_the_shapes_model(tmp_path):
    """A non-editable install has the model too: the wheel built from the sources holds its files."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "tests", "docs", "benchmarks", "deploy"))
    build = f"from setuptools import build_meta; build_meta.build_wheel({str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, check=True)
    [wheel] = tmp_path.glob("*.whl")
    shipped = ensure_builtin("shapes")
    expected = {f"runner_service/models/shapes/{p.relative_to(shipped).as_posix()}"
                for p in shipped.rglob("*") if p.is_file()}
    assert expected and expected <= set(zipfile.ZipFile(wheel).namelist())


def test_train_shapes_builds_its_pipeline_and_trains_two_steps_of_each_stage():
    """The training script runs (the real training is 40 minutes: ``train_shapes`` alone)."""
    pipeline = train(Recipe(vae_steps=2, vae_batch=2, steps=2, batch=2), torch.device("cpu"))
    assert type(pipeline).__name__ == "FluxPipeline" and pipeline.vae.config.scaling_factor > 0
    image = pipeline("a red circle", num_inference_steps=1, width=64, height=64, output_type="np").images[0]
    assert image.shape == (64, 64, 3)
