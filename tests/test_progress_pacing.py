"""Which steps' progress a paced Execute call is sent (runner_service/progress_pacing.py)."""

from __future__ import annotations

import pytest

from diffusion.v1 import common_pb2
from runner_service.progress_pacing import ProgressPacing

pytestmark = pytest.mark.unit

DENOISING, DECODING = common_pb2.PROGRESS_PHASE_DENOISING, common_pb2.PROGRESS_PHASE_DECODING


def sent(pacing: ProgressPacing, phase: int, total: int, previews_at: tuple[int, ...] = ()) -> list[int]:
    return [step for step in range(1, total + 1) if pacing.due(step, total, phase, step in previews_at)]


def test_no_interval_sends_every_step() -> None:
    pacing = ProgressPacing()
    assert sent(pacing, DENOISING, 5) == [1, 2, 3, 4, 5]
    assert sent(pacing, DECODING, 3) == [1, 2, 3]


def test_a_long_interval_sends_each_phases_first_and_last_steps_and_those_with_previews() -> None:
    pacing = ProgressPacing(interval_s=3600)
    assert sent(pacing, DENOISING, 10, previews_at=(4, 7)) == [1, 4, 7, 10]
    assert sent(pacing, DECODING, 4) == [1, 4]


def test_a_request_without_progress_gets_no_pacing() -> None:
    assert ProgressPacing.of(False, 0) is None
    paced = ProgressPacing.of(True, 250)
    assert paced is not None and paced.interval_s == 0.25
