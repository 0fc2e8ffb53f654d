"""The built-in models: built from configs, saved in diffusers format, loaded by any diffusers code."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import grpc
import pytest
from diffusers import DiffusionPipeline

from diffusion.v1 import runner_pb2
from runner_calls import execute, generate, item, pixels, refused, runner_stub
from serving_common.errors import field_violations

pytestmark = pytest.mark.process


def digests(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*.safetensors"))}


def build_model(name: str, directory) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner_service.models.build", name, str(directory)],
                          capture_output=True, text=True)


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
def test_modern_family_built_ins_load_by_name_and_generate(runner, name, pipeline_class):
    stub = runner_stub(runner.target)
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
