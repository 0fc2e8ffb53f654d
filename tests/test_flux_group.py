"""benchmarks.flux_group on two real gloo ranks: a toy FLUX transformer split by Ulysses gives the
one-device latents, and a degree with too few CUDA devices is reported as not measured, with why.

The benchmark's real case (FLUX.1-dev at full size on 1, 2 and 4 GPUs) runs in
benchmarks/gpu_check.sh; this runs the same code on the CPU so that it is not untested here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.flux_group import main, unmeasurable

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.timeout(600)]

TOY = ["--device", "cpu", "--dtype", "float32", "--layers", "1", "1", "--heads", "2", "--size", "128",
       "--steps", "2", "--text-tokens", "16", "--repeats", "1"]


def test_two_gloo_ranks_time_the_split_transformer_and_give_the_one_device_latents(tmp_path: Path) -> None:
    output = tmp_path / "flux_group.json"
    assert main([*TOY, "--degrees", "1", "2", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["notes"] == [] and report["failed"] is False
    one, two = report["measured"]
    assert (one["devices"], two["devices"]) == (1, 2)
    assert one["seconds"] > 0 and two["seconds"] > 0 and two["first_s"] > 0
    assert one["max_abs_difference"] is None
    # the same image, up to float32 rounding of the attention split over two ranks
    assert two["max_abs_difference"] < 1e-4
    assert report["config"]["transformer"]["num_attention_heads"] == 2


def test_a_degree_beyond_the_visible_cuda_devices_says_why_it_was_not_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU, which this machine lacks
    assert unmeasurable("cuda", 1) is None
    assert unmeasurable("cuda", 2) == "2 devices: only 1 CUDA device visible"
    assert unmeasurable("cuda", 4) == "4 devices: only 1 CUDA device visible"
    assert unmeasurable("cpu", 4) is None  # CPU ranks share the host


def test_nothing_measurable_fails_the_run_and_says_why(tmp_path: Path) -> None:
    output = tmp_path / "flux_group.json"
    assert not torch.cuda.is_available()  # the premise: this machine has no CUDA device
    assert main(["--device", "cuda", "--degrees", "1", "2", "--output", str(output)]) == 1
    report = json.loads(output.read_text())
    assert report["measured"] == []
    assert report["notes"] == ["1 device: only 0 CUDA devices visible", "2 devices: only 0 CUDA devices visible"]
