"""The process-wide memo of what a scheduler's class, flags and config alone decide
(``runner_service.scheduler_memo``, ``samplers.SCHEDULER_FACTS``): a model's scheduler read again
from its files (a reload) finds its samplers' schedulers and dry-run verdicts there, a different
config does not, what ``scheduler_for`` hands out is a copy whose changes never reach the memo, a
config the memo cannot key by value is built every time, and the memo stays bounded and shared
safely between threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, KDPM2DiscreteScheduler

from runner_service.pipeline_adapter import scheduler_max_steps
from runner_service.samplers import SCHEDULER_FACTS, schedule_runs, scheduler_for
from runner_service.scheduler_memo import BoundedMemo, Unkeyable, frozen

pytestmark = pytest.mark.unit


def stable_diffusion_scheduler(directory: Path, **changes: object) -> DDIMScheduler:
    """A Stable-Diffusion-shaped DDIM scheduler as a load reads it: from its saved config."""
    config = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1,
              "set_alpha_to_one": False, "clip_sample": False}
    DDIMScheduler(**{**config, **changes}).save_config(directory)
    scheduler: DDIMScheduler = DDIMScheduler.from_pretrained(directory)
    return scheduler


def same_state(a: Any, b: Any) -> bool:
    """Two schedulers of one class with the same config and the same schedule."""
    return (type(a) is type(b) and dict(a.config) == dict(b.config)
            and torch.equal(a.timesteps, b.timesteps) and torch.equal(a.sigmas, b.sigmas))


def test_a_reload_finds_its_schedulers_and_verdicts_in_the_memo(tmp_path):
    loaded = stable_diffusion_scheduler(tmp_path)
    first = scheduler_for(loaded, "dpm2"), scheduler_max_steps(loaded)
    computed = SCHEDULER_FACTS.computed
    reloaded = stable_diffusion_scheduler(tmp_path)
    assert reloaded is not loaded
    second = scheduler_for(reloaded, "dpm2"), scheduler_max_steps(reloaded)
    assert SCHEDULER_FACTS.computed == computed  # nothing built nor dry-run again
    assert same_state(first[0], second[0]) and first[1] == second[1] == 999
    assert same_state(second[0], KDPM2DiscreteScheduler.from_config(reloaded.config))


def test_a_different_config_is_not_reused(tmp_path):
    loaded = stable_diffusion_scheduler(tmp_path / "a")
    scheduler_for(loaded, "dpm2")
    computed = SCHEDULER_FACTS.computed
    other = stable_diffusion_scheduler(tmp_path / "b", beta_end=0.02)
    built = scheduler_for(other, "dpm2")
    assert SCHEDULER_FACTS.computed == computed + 1
    assert built.config.beta_end == 0.02
    assert same_state(built, KDPM2DiscreteScheduler.from_config(other.config))
    leading = schedule_runs(loaded, 1000), schedule_runs(stable_diffusion_scheduler(tmp_path / "c", steps_offset=0),
                                                           1000)
    assert leading == (False, True)  # diffusers issue 10003 only where the timesteps are offset


def test_a_handed_out_scheduler_never_changes_the_memo(tmp_path):
    loaded = stable_diffusion_scheduler(tmp_path)
    handed = scheduler_for(loaded, "dpm2")
    handed.set_timesteps(4)
    handed.step(torch.zeros(1, 1, 1, 1), handed.timesteps[0], torch.zeros(1, 1, 1, 1))
    handed.sigmas.mul_(0)
    handed.register_to_config(beta_end=0.5)
    again = scheduler_for(loaded, "dpm2")
    assert again is not handed
    assert same_state(again, KDPM2DiscreteScheduler.from_config(loaded.config))


def test_a_config_it_cannot_key_is_built_every_time(tmp_path):
    # Kept in the built scheduler's config, as diffusers keeps any key it does not take.
    odd = DDIMScheduler.from_config({**stable_diffusion_scheduler(tmp_path).config, "note": object()})
    entries, computed = len(SCHEDULER_FACTS), SCHEDULER_FACTS.computed
    built = scheduler_for(odd, "")
    assert type(built) is DDIMScheduler and "note" in built.config
    assert schedule_runs(odd, 999)
    assert (len(SCHEDULER_FACTS), SCHEDULER_FACTS.computed) == (entries, computed)


def test_keys_tell_apart_what_a_build_could_tell_apart():
    assert frozen({"a": 1}) == frozen({"a": 1}) and hash(frozen({"a": [1.5, None]})) == hash(frozen({"a": [1.5, None]}))
    for a, b in [(1, 1.0), (1, True), (0.0, -0.0), ([1], (1,)), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
                 (np.float32(0.1), 0.1), (np.array([1, 2]), np.array([1.0, 2.0])), (np.array([1, 2]), [1, 2])]:
        assert frozen(a) != frozen(b), (a, b)
    assert frozen(float("nan")) == frozen(float("nan"))
    assert frozen(np.arange(3)) == frozen(np.arange(3))
    assert frozen(DDIMScheduler) == frozen(DDIMScheduler) != frozen(KDPM2DiscreteScheduler)
    for unkeyable in (object(), np.array([object()]), {"a": [object()]}):
        with pytest.raises(Unkeyable):
            frozen(unkeyable)


def test_the_memo_keeps_the_most_recently_used_entries():
    memo = BoundedMemo(entries=2)
    assert memo.get("a", lambda: 1) == 1 and memo.get("b", lambda: 2) == 2
    assert memo.get("a", lambda: -1) == 1  # held: "b" is now the least recently used
    assert memo.get("c", lambda: 3) == 3
    assert len(memo) == 2 and memo.computed == 3
    assert memo.get("b", lambda: 20) == 20 and memo.get("a", lambda: -1) == -1


def test_a_value_stored_while_another_computed_it_is_the_one_kept():
    memo = BoundedMemo(entries=4)
    # The outer computation misses, and the same key is stored before it ends, as by another thread.
    assert memo.get("k", lambda: memo.get("k", lambda: "first") and "second") == "first"
    assert memo.get("k", lambda: "third") == "first"


def test_threads_share_one_memo():
    memo = BoundedMemo(entries=8)
    threads_count, rounds = 4, 200
    start = threading.Barrier(threads_count)
    wrong: list[tuple[int, int]] = []

    def hammer() -> None:
        start.wait()
        for n in range(rounds):
            key = n % 16
            if memo.get(key, lambda key=key: key * key) != key * key:
                wrong.append((key, n))

    threads = [threading.Thread(target=hammer) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and len(memo) == 8
