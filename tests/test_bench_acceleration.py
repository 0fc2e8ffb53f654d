"""The acceleration benchmarks' own arithmetic: PSNR, error, adherence, weight bytes, which targets a
run missed, the table; and the GPU real-size case runs end to end at a toy size on the CPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.bench_acceleration import (
    PLAIN,
    Measured,
    adherence,
    cache_alone,
    cache_setting,
    configurations,
    denoiser_bytes,
    mean_absolute_error,
    missed,
    psnr_db,
    table,
    unoffered,
)
from diffusion.v1 import common_pb2
from runner_service.models.shapes_scenes import Scene, draw
from serving_common.input_rules import AccelerationPlan

pytestmark = pytest.mark.unit

SCENES = [Scene("red", "circle", "blue", "on the left"), Scene("yellow", "square", "black", "at the top")]
CACHE_01 = AccelerationPlan(cache="first_block_cache", cache_threshold=0.1)


def measured(speedup: float = 1.0, psnr: float | None = None, adherence: float = 0.5,
             max_difference: int = 0) -> Measured:
    return Measured(first_call_s=1.0, seconds_per_image=1.0 / speedup, speedup=speedup, psnr_db=psnr,
                    mean_absolute_error=0.0, max_pixel_difference=max_difference, adherence=adherence,
                    readings_differing=0, skipped_share=None, denoiser_bytes=1_000_000)


def test_psnr_and_mean_absolute_error_against_the_plain_images() -> None:
    reference = [np.zeros((4, 4, 3), np.uint8), np.full((4, 4, 3), 200, np.uint8)]
    off_by_one = [image + 1 for image in reference]
    assert psnr_db(reference, reference) == math.inf
    assert psnr_db(reference, off_by_one) == pytest.approx(10 * math.log10(255 ** 2))
    assert mean_absolute_error(reference, off_by_one) == 1.0
    half_off = [reference[0], reference[1] - 4]  # pooled: the mean squared error over both images is 8
    assert psnr_db(reference, half_off) == pytest.approx(10 * math.log10(255 ** 2 / 8))
    assert mean_absolute_error(reference, half_off) == 2.0


def test_adherence_counts_scenes_read_right_in_every_property() -> None:
    drawn = [draw(scene, 64, 64, random.Random(index)) for index, scene in enumerate(SCENES)]
    assert adherence(SCENES, drawn) == 1.0
    assert adherence(SCENES, [drawn[0], drawn[0]]) == 0.5


def test_weight_bytes_count_parameters_and_buffers_in_their_dtype() -> None:
    layer = torch.nn.Linear(4, 3)
    assert denoiser_bytes(layer) == (12 + 3) * 4
    assert denoiser_bytes(layer.half()) == (12 + 3) * 2
    norm = torch.nn.BatchNorm1d(5)  # 2 parameters and 3 buffers (one an int64 counter)
    assert denoiser_bytes(norm) == 4 * 5 * 4 + 8


def test_weight_bytes_of_an_int8_quantized_layer_are_its_int8_data_and_scales() -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    layer = torch.nn.Linear(64, 64)
    assert denoiser_bytes(layer) == (64 * 64 + 64) * 4
    quantize_(layer, Int8WeightOnlyConfig())
    int8_weights_and_float_bias = 64 * 64 + 64 * 4
    assert int8_weights_and_float_bias < denoiser_bytes(layer) < (64 * 64 + 64) * 4 / 3


def test_configurations_are_plain_then_each_method_alone_then_cache_and_compile() -> None:
    plans = configurations([0.1, 0.2], [2], CACHE_01, "int8-weight-only", ["_native_math"])
    assert list(plans) == [PLAIN, "cache 0.1", "cache 0.1 warmup 2", "cache 0.2", "cache 0.2 warmup 2", "compile",
                           "int8-weight-only", "attention _native_math", "cache 0.1 + compile"]
    assert plans[PLAIN].plain
    assert plans["cache 0.2 warmup 2"] == AccelerationPlan(cache="first_block_cache", cache_threshold=0.2,
                                                          cache_warmup_steps=2)
    assert [name for name, plan in plans.items() if cache_alone(plan)] == [
        "cache 0.1", "cache 0.1 warmup 2", "cache 0.2", "cache 0.2 warmup 2"]
    assert list(configurations([0.1], [0], CACHE_01, "", [])) == [PLAIN, "cache 0.1", "compile", "cache 0.1 + compile"]
    assert list(configurations([0.2], [2, 4], CACHE_01, "int8-weight-only", ["_native_math"], cache_only=True)) == [
        PLAIN, "cache 0.2", "cache 0.2 warmup 2", "cache 0.2 warmup 4"]


def test_the_cache_with_compile_is_any_method_at_its_default_or_a_setting_given() -> None:
    default = AccelerationPlan(cache="taylorseer", cache_threshold=3, cache_warmup_steps=4)
    assert cache_setting("taylorseer") == default
    assert cache_setting("taylorseer:2") == dataclasses.replace(default, cache_threshold=2)
    assert cache_setting("first_block_cache:0.1:0") == CACHE_01
    assert list(configurations([], [0], cache_setting("taylorseer"), "", [])) == [
        PLAIN, "compile", "taylorseer 3 warmup 4 + compile"]
    assert list(configurations([], [0], None, "", [])) == [PLAIN, "compile"]
    for wrong in ("fast_cache", "taylorseer:two", "taylorseer:2:4:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="METHOD|could not convert"):
            cache_setting(wrong)


def test_a_method_the_runner_does_not_offer_is_named() -> None:
    offered = common_pb2.AccelerationOffer(cache_methods=["first_block_cache"], attention_backends=["native"],
                                           compile=False)
    assert unoffered(AccelerationPlan(cache="first_block_cache", cache_threshold=0.1), offered) == []
    assert unoffered(AccelerationPlan(compile=True, quantization="int8-weight-only", attention_backend="flex"),
                     offered) == ["compile", "int8-weight-only", "attention backend flex"]


def test_the_cache_target_needs_speed_quality_and_adherence_from_the_cache_alone() -> None:
    plans = configurations([0.1, 0.2], [0], CACHE_01, "", [])
    met = {PLAIN: measured(), "cache 0.1": measured(1.2, 40.0), "cache 0.2": measured(1.6, 31.0),
           "compile": measured(1.1, 60.0, max_difference=2), "cache 0.1 + compile": measured(2.0, 40.0)}
    assert missed(plans, {128: met}, {}) == []
    blurred = {**met, "cache 0.2": measured(1.6, 29.0)}
    misread = {**met, "cache 0.2": measured(1.6, 31.0, adherence=0.45)}
    compile_off = {**met, "compile": measured(1.1, 50.0, max_difference=3)}
    assert missed(plans, {64: blurred, 128: misread}, {"int8-weight-only": ["int8-weight-only"]}) == [
        "int8-weight-only: not offered (int8-weight-only)",
        "64px: no cache setting >= 1.5x at >= 30 dB with adherence >= plain's (fastest: cache 0.2, 1.60x at 29.0 dB)",
        "128px: no cache setting >= 1.5x at >= 30 dB with adherence >= plain's (fastest: cache 0.2, 1.60x at 31.0 dB)",
    ]
    assert missed(plans, {64: compile_off}, {}) == ["64px: compile differs from eager by 3/255 > 2/255"]


def test_the_cache_with_compile_must_compile_nothing_more_and_beat_compile_alone() -> None:
    plans = configurations([], [0], CACHE_01, "", [])
    met = {PLAIN: measured(), "compile": measured(1.2, 60.0), "cache 0.1 + compile": measured(1.5, 40.0)}
    assert missed(plans, {64: met}, {}) == []
    slow = {**met, "cache 0.1 + compile": measured(1.4, 40.0)}
    assert missed(plans, {64: slow}, {}) == ["64px: cache 0.1 + compile 1.17x compile alone < 1.2x"]
    recompiling = {**met, "cache 0.1 + compile": dataclasses.replace(measured(1.5, 40.0), graphs_compiled=3,
                                                                      recompile_limit_hit=True)}
    assert missed(plans, {64: recompiling}, {}) == [
        "64px: cache 0.1 + compile compiled 3 graphs after its first call, past dynamo's recompile limit"]


def test_the_table_has_a_row_per_size_and_configuration() -> None:
    rows = table({64: {PLAIN: measured(), "cache 0.1": measured(1.5, 35.25)}}).splitlines()
    assert len(rows) == 4
    assert rows[2].startswith("| 64 | plain | 1.00 | 1.000 | 1.00x | identical | 0.00 | 0 |  | 50% | 0 | 1.00 |")
    assert "| 1.50x | 35.2 dB |" in rows[3]


def test_flux_full_runs_a_toy_flux_transformer_plain_and_cached_on_the_cpu(tmp_path: Path) -> None:
    from benchmarks.flux_full import FLUX_DEV, flux_config, main

    assert flux_config(19, 38, 24) == FLUX_DEV
    assert (FLUX_DEV["num_layers"], FLUX_DEV["num_single_layers"], FLUX_DEV["num_attention_heads"],
            FLUX_DEV["attention_head_dim"], FLUX_DEV["joint_attention_dim"], FLUX_DEV["pooled_projection_dim"],
            FLUX_DEV["in_channels"], FLUX_DEV["guidance_embeds"]) == (19, 38, 24, 128, 4096, 768, 64, True)
    output = tmp_path / "flux_full.json"
    assert main(["--device", "cpu", "--dtype", "float32", "--layers", "1", "1", "--heads", "2", "--size", "128",
                 "--text-tokens", "16", "--steps", "2", "--repeats", "1", "--stages", "plain", "cache",
                 "--output", str(output)]) == 0
    written = json.loads(output.read_text())
    assert [stage["name"] for stage in written["stages"]] == ["plain", "cache"]
    assert written["stages"][1]["plan"]["cache"] == "first_block_cache"
    assert 0 <= written["stages"][1]["skipped_share"] <= 1
    assert written["missed"] is False
