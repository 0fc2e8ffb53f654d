"""``benchmarks/bench_group`` end to end at a toy size (tiny Flux's own transformer, 16 text
tokens, 2 steps, 1 request of each kind): real workers, single runners, replicas and two-rank
groups; what it writes has every figure ``docs/benchmarks.md`` reports, each counted over the
rounds and requests asked, and each ratio is the one its figures give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_group import LATENCY, THROUGHPUT, main

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(900)]

# One round: every system starts afresh each round, and what a round writes is the same each time.
# One request of each kind (and per client): the figures are counted over what was asked, whatever
# the count; the cost of the run is its system starts.
REQUESTS, THROUGHPUT_REQUESTS, ROUNDS = 1, 1, 1


def test_a_toy_run_writes_every_figure(tmp_path: Path) -> None:
    output = tmp_path / "group.json"
    results = main(["--layers", "1", "--single-layers", "1", "--heads", "2", "--head-dim", "16",
                    "--text-tokens", "16", "--size", "32", "--steps", "2", "--requests", str(REQUESTS),
                    "--throughput-requests", str(THROUGHPUT_REQUESTS), "--rounds", str(ROUNDS),
                    "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(results))
    assert results["model"]["transformer_parameters"] > 0

    latency = results["latency"]
    assert set(latency) == {system.name for system in LATENCY}
    one_2, one_1 = LATENCY[0].name, LATENCY[1].name
    for system in LATENCY:
        assert set(latency[system.name]) == set(system.kinds)
        for kind, figures in latency[system.name].items():
            assert [run["n"] for run in figures["rounds"]] == [REQUESTS] * ROUNDS
            assert figures["best_p50_ms"] == min(run["p50"] for run in figures["rounds"]) > 0
            assert figures[f"to_{one_2}"] == pytest.approx(figures["best_p50_ms"] / latency[one_2][kind]["best_p50_ms"])
            assert figures[f"to_{one_1}"] == pytest.approx(figures["best_p50_ms"] / latency[one_1][kind]["best_p50_ms"])
    assert latency[one_2]["guided"][f"to_{one_2}"] == 1.0
    assert set(latency["group_ulysses"]) == {"guided", "unguided"} and set(latency["group_cfg"]) == {"guided"}

    throughput = results["throughput"]
    assert set(throughput) == {system.name for system in THROUGHPUT}
    for figures in throughput.values():
        assert [run["requests"] for run in figures["rounds"]] == [2 * THROUGHPUT_REQUESTS] * ROUNDS
        for run in figures["rounds"]:
            assert run["requests_per_s"] == pytest.approx(run["requests"] / run["seconds"])
        assert figures["best_requests_per_s"] == max(run["requests_per_s"] for run in figures["rounds"])
        assert figures["to_replicas"] == pytest.approx(
            figures["best_requests_per_s"] / throughput["replicas"]["best_requests_per_s"])
    assert len(results["machine"]["load_average_after"]) == 3
