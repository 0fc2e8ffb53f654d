"""The benchmarks' requests are not shaped to flatter one of our features."""

from __future__ import annotations

import pytest

from benchmarks.bench import PROMPT, prompt_for

pytestmark = pytest.mark.unit


def test_every_request_has_its_own_prompt_by_default() -> None:
    prompts = [prompt_for(index) for index in range(1000)]
    assert len(set(prompts)) == len(prompts)
    assert PROMPT not in prompts


def test_the_repeat_rate_repeats_that_share_of_prompts_the_same_for_every_caller() -> None:
    prompts = [prompt_for(index, repeat_rate=0.25) for index in range(4000)]
    repeated = prompts.count(PROMPT)
    assert 800 < repeated < 1200
    assert prompts == [prompt_for(index, repeat_rate=0.25) for index in range(4000)]
    assert len(set(prompts)) == len(prompts) - repeated + 1
