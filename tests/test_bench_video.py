"""``benchmarks/bench_video`` end to end at a toy size: a real worker and runners serving ``tiny-wan``,
the in-process pipeline beside them; what it writes has every figure ``docs/benchmarks.md`` reports,
counted over the rounds asked, and the served frames equal the in-process ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_video import main

pytestmark = [pytest.mark.process, pytest.mark.slow]

SIZE, FRAMES, REPEATS = 32, 5, 1  # one round: each figure is counted over the rounds asked
MEMORY_SIZE, MEMORY_FRAMES, MEMORY_TILE = 64, 5, 32


def test_a_toy_run_writes_every_figure(tmp_path: Path) -> None:
    output = tmp_path / "video.json"
    results = main(["--size", str(SIZE), "--frames", str(FRAMES), "--steps", "2", "--repeats", str(REPEATS),
                    "--memory-size", str(MEMORY_SIZE), "--memory-frames", str(MEMORY_FRAMES),
                    "--memory-tile", str(MEMORY_TILE), "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(results))

    assert results["identical"]["frames"] == FRAMES
    assert results["identical"]["max_pixel_difference"] <= 1  # issue 26: the pipeline's own frames within 1/255
    hop = results["hop"]
    assert hop["service_ms"]["n"] == hop["inprocess_ms"]["n"] == hop["runner_execute_ms"]["n"] == REPEATS
    assert hop["hop_ms"]["n"] == REPEATS
    assert hop["median_ratio"] == pytest.approx(hop["service_ms"]["p50"] / hop["inprocess_ms"]["p50"])
    mp4 = hop["mp4"]
    assert mp4["service_ms"]["n"] == mp4["encode_ms"]["n"] == REPEATS
    assert mp4["bytes"] > 0
    assert mp4["median_ratio_to_raw"] == pytest.approx(mp4["service_ms"]["p50"] / hop["service_ms"]["p50"])

    memory = results["decode_memory"]
    for name in ("untiled", "default_tiles", "budget"):
        run = memory[name]
        assert run["frame_bytes"] == MEMORY_FRAMES * MEMORY_SIZE * MEMORY_SIZE * 3
        assert run["peak_after_mb"] >= run["peak_before_mb"] >= run["rss_before_mb"] > 0
        assert run["growth_mb"] == pytest.approx(run["peak_after_mb"] - run["rss_before_mb"])
        assert memory["peak_ratio"][name] == pytest.approx(run["peak_after_mb"] / memory["untiled"]["peak_after_mb"])
    # the toy's decode can fit in what the warm-up left, so there may be no growth to compare with
    assert memory["growth_ratio"]["untiled"] == (1.0 if memory["untiled"]["growth_mb"] > 0 else None)
    assert memory["untiled"]["tile"] == memory["default_tiles"]["tile"] == 0  # smaller than diffusers' tile
    assert memory["budget"]["tile"] == MEMORY_TILE  # the budget is the runner's estimate for these tiles
    assert memory["budget"]["estimate_mb"] == memory["budget_mb"] < memory["untiled"]["estimate_mb"]
