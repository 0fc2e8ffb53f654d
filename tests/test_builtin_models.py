"""The built-in models: built from configs, saved in diffusers format, loaded by any diffusers code."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from diffusers import DiffusionPipeline


def digests(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*.safetensors"))}


def test_build_model_writes_a_loadable_pipeline_with_the_same_bytes_every_time(tmp_path):
    for name in ("one", "two"):
        subprocess.run([sys.executable, "-m", "runner_service.models.build", "tiny", str(tmp_path / name)],
                       check=True, capture_output=True)
    assert digests(tmp_path / "one") == digests(tmp_path / "two") != {}
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "one")
    assert type(pipeline).__name__ == "StableDiffusionPipeline"
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(pipeline.components)


def test_build_model_refuses_to_overwrite(tmp_path):
    subprocess.run([sys.executable, "-m", "runner_service.models.build", "tiny", str(tmp_path / "m")], check=True)
    again = subprocess.run([sys.executable, "-m", "runner_service.models.build", "tiny", str(tmp_path / "m")],
                           capture_output=True, text=True)
    assert again.returncode != 0 and "already holds a model" in again.stderr
