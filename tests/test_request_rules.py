"""The request rules (``serving_common.input_rules``), tested once: the worker and the runner both
map their messages onto them. No processes, no network."""

from __future__ import annotations

import math

import pytest

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.errors import ServiceError
from serving_common.input_rules import (
    CACHE_DEFAULTS,
    CACHE_METHODS,
    FIRST_BLOCK_CACHE,
    MAX_PATH_CHARS,
    QUANTIZATIONS,
    TASK_INPUTS,
    ModelTerms,
    SizeGrid,
    acceleration_violations,
    adapter_name_problem,
    adapter_scale_problem,
    cache_threshold_problem,
    check_text,
    chosen_task,
    count_problem,
    guidance_problem,
    negative_prompt_problem,
    request_id_problem,
    strength_problem,
    task_inputs,
    task_label,
    task_violations,
    text_problem,
    text_violations,
    true_cfg_problem,
    with_cache_defaults,
)
from worker_service.config import Limits
from worker_service.validation import ValidationError, normalize

T = common_pb2
pytestmark = pytest.mark.unit


# -- strings and names -----------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "at"), [("a\x00b", 1), ("line\nforged", 4), ("esc\x1b[2J", 3), ("del\x7f", 3),
                                           ("c1\x85", 2), ("sep\u2028", 3)])
def test_a_control_character_is_refused_saying_where(value: str, at: int) -> None:
    assert text_problem(value) == f"must not contain control characters ({value[at]!r} at {at})"


def test_text_is_bounded_and_named_per_field() -> None:
    assert text_problem("/tmp/fine path/é.safetensors") is None
    assert text_problem("x" * MAX_PATH_CHARS) is None
    assert text_problem("x" * (MAX_PATH_CHARS + 1)) == f"must be at most {MAX_PATH_CHARS} characters, got 4097"
    assert text_problem("abcd", max_chars=3) == "must be at most 3 characters, got 4"
    assert [field for field, _ in text_violations([("path", "ok"), ("model", "a\x00"), ("tag", "b\n")])] == \
        ["model", "tag"]
    check_text([("path", "fine")])
    with pytest.raises(ServiceError) as caught:
        check_text([("path", "a\x00"), ("name", "ok")])
    assert caught.value.code.name == "INVALID_ARGUMENT" and [f for f, _ in caught.value.violations] == ["path"]


@pytest.mark.parametrize(("name", "valid"), [("style", True), ("style-v_2", True), ("x" * 64, True),
                                             ("style.v2", False), ("", False), ("x" * 65, False),
                                             ("sty le", False), ("é", False), ("a\x00", False)])
def test_adapter_names_are_those_peft_can_load(name: str, valid: bool) -> None:
    assert (adapter_name_problem(name) is None) is valid


@pytest.mark.parametrize(("request_id", "problem"), [
    ("req-1", None),
    ("~!#$%&", None),
    ("x" * 128, None),
    ("x" * 129, "must be at most 128 characters, got 129"),
    ("has space", "must be printable ASCII without spaces"),
    ("a\r\nb", "must be printable ASCII without spaces"),
    ("café", "must be printable ASCII without spaces"),
    ("", "must be printable ASCII without spaces"),
])
def test_request_ids_are_printable_ascii_within_a_sides_length(request_id: str, problem: str | None) -> None:
    assert request_id_problem(request_id, 128) == problem


# -- numbers ---------------------------------------------------------------------------------------

def test_counts_run_from_one() -> None:
    assert count_problem(1, 4) is None and count_problem(4, 4) is None
    assert count_problem(0, 4) == "must be 1 to 4, got 0"
    assert count_problem(5, 4) == "must be 1 to 4, got 5"


@pytest.mark.parametrize("scale", [0.0, 7.5, 100.0])
def test_guidance_in_bounds(scale: float) -> None:
    assert guidance_problem(scale, 100) is None


@pytest.mark.parametrize("scale", [-1.0, 100.5, 3e38, math.inf, -math.inf, math.nan])
def test_guidance_out_of_bounds_or_not_finite(scale: float) -> None:
    assert guidance_problem(scale, 100) == f"must be 0 to 100, got {scale:g}"


def test_adapter_scales_go_either_way_within_the_bound() -> None:
    assert adapter_scale_problem(-10, 10) is None and adapter_scale_problem(0, 10) is None
    assert adapter_scale_problem(10.5, 10) == "must be from -10 to 10, got 10.5"
    assert adapter_scale_problem(1e30, 100) == "must be from -100 to 100, got 1e+30"
    assert adapter_scale_problem(math.nan, 100) is not None


# -- the size grid ---------------------------------------------------------------------------------

def test_the_grid_is_the_models_multiple_as_it_is_not_one_of_eight_laid_over_it() -> None:
    grid = SizeGrid.of(4, 12, 0, floor=8, ceiling=64)
    assert (grid.multiple, grid.smallest, grid.largest) == (4, 12, 64)
    assert grid.problem(12) is None and grid.problem(20) is None  # not multiples of 8, on the grid
    assert grid.problem(14) == "must be a multiple of 4 from 12 to 64, got 14"
    assert grid.problem(8) is not None and grid.problem(68) is not None


def test_the_tighter_of_a_sides_bounds_and_the_models_hold() -> None:
    tiny = SizeGrid.of(8, 24, 0, floor=0, ceiling=2048)  # the runner's own: no floor of its own
    assert (tiny.smallest, tiny.largest) == (24, 2048)
    assert tiny.problem(16) is not None and tiny.problem(60) is not None and tiny.problem(4096) is not None
    capped = SizeGrid.of(128, 128, 256, floor=8, ceiling=2048)  # the model's max_size is tighter
    assert capped.problem(384) == "must be a multiple of 128 from 128 to 256, got 384"
    floored = SizeGrid.of(8, 8, 4096, floor=64, ceiling=1024)  # the side's bounds are tighter
    assert (floored.smallest, floored.largest) == (64, 1024)


def test_no_model_reported_is_a_grid_of_one_within_the_bounds() -> None:
    grid = SizeGrid.of(0, 0, 0, floor=8, ceiling=2048)
    assert (grid.multiple, grid.smallest, grid.largest) == (1, 8, 2048)
    assert grid.problem(65) is None and grid.problem(7) is not None
    assert SizeGrid.of(0, 0, 0, floor=0, ceiling=2048).smallest == 1


def test_both_ends_are_rounded_onto_the_grid() -> None:
    grid = SizeGrid.of(3, 0, 1000, floor=8, ceiling=2048)
    assert (grid.smallest, grid.largest) == (9, 999)
    assert all((grid.problem(size) is None) == (size % 3 == 0 and 8 <= size <= 1000) for size in range(0, 1010))


def test_the_default_size_is_rounded_up_onto_the_grid() -> None:
    assert SizeGrid.of(128, 128, 256, floor=8, ceiling=2048).default(64) == 128
    assert SizeGrid.of(48, 0, 0, floor=8, ceiling=2048).default(64) == 96
    assert SizeGrid.of(8, 24, 0, floor=8, ceiling=2048).default(64) == 64


@pytest.mark.parametrize("model", [None, common_pb2.ModelInfo(min_size=24, size_multiple=8),
                                   common_pb2.ModelInfo(min_size=32, size_multiple=16, max_size=128)])
def test_the_worker_takes_exactly_the_sizes_of_the_grid(model: common_pb2.ModelInfo | None) -> None:
    limits = Limits()
    grid = SizeGrid.of(model.size_multiple if model else 0, model.min_size if model else 0,
                       model.max_size if model else 0, floor=limits.min_size, ceiling=limits.max_size)
    for size in range(1, 200):
        try:
            normalize(worker_pb2.GenerateRequest(width=size, height=64), limits, (), model=model)
            refused = None
        except ValidationError as error:
            refused = dict(error.violations).get("width")
        assert refused == grid.problem(size), size


# -- what a model takes ----------------------------------------------------------------------------

def terms(**fields: object) -> ModelTerms:
    values: dict[str, object] = dict(name="SomePipeline", tasks=(T.TASK_TEXT_TO_IMAGE,), negative_prompt=True,
                                     guidance=T.GUIDANCE_KIND_CLASSIFIER_FREE, default_guidance=7.5,
                                     true_cfg=False, default_true_cfg=0.0)
    values.update(fields)
    return ModelTerms(**values)  # type: ignore[arg-type]


SD = terms()
FLUX = terms(negative_prompt=True, guidance=T.GUIDANCE_KIND_DISTILLED, true_cfg=True, default_true_cfg=1.0)
QWEN = terms(guidance=T.GUIDANCE_KIND_TRUE_CFG, true_cfg=True, default_true_cfg=4.0)


def test_true_cfg_is_separate_only_beside_another_guidance() -> None:
    assert FLUX.separate_true_cfg and not QWEN.separate_true_cfg and not SD.separate_true_cfg


def test_a_true_cfg_scale_only_where_it_is_the_models_own() -> None:
    assert true_cfg_problem(FLUX, 4, 100) is None
    assert true_cfg_problem(FLUX, -1, 100) == "must be 0 to 100, got -1"
    assert true_cfg_problem(SD, 4, 100) == "SomePipeline takes no true_cfg_scale"
    assert "guidance_scale" in (true_cfg_problem(QWEN, 4, 100) or "")
    assert true_cfg_problem(None, 4, 100) is None and true_cfg_problem(None, math.inf, 100) is not None


def test_an_acceleration_is_checked_for_its_own_consistency_and_short_names() -> None:
    acceleration = common_pb2.Acceleration
    valid = acceleration(cache="first_block_cache", cache_threshold=0.2, quantization="int8-weight-only",
                         attention_backend="_native_math")
    assert acceleration_violations(valid) == []
    assert acceleration_violations(acceleration(cache="first_block_cache")) == [], "0: the method's default"
    assert [field for field, _ in acceleration_violations(acceleration(cache="first_block_cache",
                                                                       cache_threshold=-0.1))] == [
        "acceleration.cache_threshold"]
    assert [field for field, _ in acceleration_violations(acceleration(cache_warmup_steps=2))] == ["acceleration.cache"]
    long = acceleration(quantization="x" * 65, attention_backend="flash\n")
    assert [field for field, _ in acceleration_violations(long)] == ["acceleration.quantization",
                                                                     "acceleration.attention_backend"]


def test_an_unknown_cache_or_quantization_is_named_before_what_follows_from_it() -> None:
    """A cache no runner offers is the cause; its bad threshold comes second (Init and the flags)."""
    acceleration = common_pb2.Acceleration
    unknown = acceleration_violations(acceleration(cache="nope", quantization="int4", cache_threshold=math.nan))
    assert [field for field, _ in unknown] == ["acceleration.cache", "acceleration.quantization",
                                               "acceleration.cache_threshold"]
    assert "'nope'" in unknown[0][1] and "first_block_cache" in unknown[0][1]
    assert "int8-weight-only" in unknown[1][1]
    assert acceleration_violations(acceleration(cache=CACHE_METHODS[0], cache_threshold=0.1,
                                                quantization=QUANTIZATIONS[-1])) == []


def test_a_cache_without_a_threshold_takes_its_methods_default_and_an_explicit_one_is_kept() -> None:
    acceleration = common_pb2.Acceleration
    default = CACHE_DEFAULTS[FIRST_BLOCK_CACHE]
    assert set(CACHE_DEFAULTS) == set(CACHE_METHODS)
    assert with_cache_defaults(acceleration(cache=FIRST_BLOCK_CACHE, quantization="int8-weight-only")) == acceleration(
        cache=FIRST_BLOCK_CACHE, cache_threshold=default.threshold, cache_warmup_steps=default.warmup_steps,
        quantization="int8-weight-only")
    assert with_cache_defaults(acceleration(cache=FIRST_BLOCK_CACHE, cache_warmup_steps=1)) == acceleration(
        cache=FIRST_BLOCK_CACHE, cache_threshold=default.threshold, cache_warmup_steps=1)
    explicit = acceleration(cache=FIRST_BLOCK_CACHE, cache_threshold=0.05)
    assert with_cache_defaults(explicit) == explicit, "an explicit threshold keeps its warmup steps (0 here)"
    assert with_cache_defaults(acceleration(quantization="int8-weight-only")) == acceleration(
        quantization="int8-weight-only")


def test_a_cache_threshold_above_0_only_on_a_model_with_a_cache() -> None:
    cached = "first_block_cache"
    assert cache_threshold_problem(0.3, cached) is None and cache_threshold_problem(0, cached) is None
    assert cache_threshold_problem(0, "") is None, "0 (no caching) is every model's"
    assert cache_threshold_problem(0.1, "", "SomePipeline") == (
        "SomePipeline was loaded without a step cache (Init with acceleration.cache); 0 or unset only")
    assert cache_threshold_problem(0.1, None) is None, "not known: the runner decides"
    for bad in (-0.1, math.nan, math.inf):
        assert cache_threshold_problem(bad, cached) == f"must be finite and >= 0, got {bad:g}"


def test_a_negative_prompt_only_where_the_model_uses_it() -> None:
    assert negative_prompt_problem(SD, None) is None and negative_prompt_problem(QWEN, None) is None
    assert negative_prompt_problem(terms(negative_prompt=False), None) == "SomePipeline takes no negative prompt"
    assert negative_prompt_problem(FLUX, 4) is None
    assert negative_prompt_problem(FLUX, 1) == "SomePipeline uses a negative prompt only with a true_cfg_scale above 1"
    assert negative_prompt_problem(FLUX, None) is not None  # its default, 1, is not above 1
    assert negative_prompt_problem(terms(guidance=T.GUIDANCE_KIND_DISTILLED, true_cfg=True, default_true_cfg=2),
                                   None) is None
    assert negative_prompt_problem(None, None) is None  # capabilities not known


# -- tasks and their inputs ------------------------------------------------------------------------

def test_what_each_task_takes() -> None:
    assert set(TASK_INPUTS) == set(T.Task.values()) - {T.TASK_UNSPECIFIED}
    assert [(t.image, t.mask, t.strength) for t in map(task_inputs, (T.TASK_TEXT_TO_IMAGE, T.TASK_IMAGE_TO_IMAGE,
                                                                      T.TASK_INPAINT, T.TASK_EDIT, 99))] == \
        [(False, False, False), (True, False, True), (True, True, True), (True, False, False), (False, False, False)]
    assert task_label(T.TASK_INPAINT) == "TASK_INPAINT" and task_label(99) == "99"


ALL = (T.TASK_TEXT_TO_IMAGE, T.TASK_IMAGE_TO_IMAGE, T.TASK_INPAINT)


@pytest.mark.parametrize(("image", "mask", "served", "task"), [
    (False, False, ALL, T.TASK_TEXT_TO_IMAGE),
    (True, False, ALL, T.TASK_IMAGE_TO_IMAGE),
    (True, True, ALL, T.TASK_INPAINT),
    (False, True, ALL, T.TASK_INPAINT),
    (True, False, (T.TASK_EDIT,), T.TASK_EDIT),
    (True, False, ALL + (T.TASK_EDIT,), T.TASK_EDIT),
])
def test_an_unset_task_follows_from_the_inputs(image: bool, mask: bool, served: tuple[int, ...], task: int) -> None:
    assert chosen_task(0, image, mask, served) == task
    assert chosen_task(T.TASK_IMAGE_TO_IMAGE, image, mask, served) == T.TASK_IMAGE_TO_IMAGE  # asked: as asked


def test_a_task_needs_its_inputs_and_takes_no_others() -> None:
    assert task_violations(T.TASK_INPAINT, ALL, "M", image=True, mask=True) == []
    assert task_violations(T.TASK_IMAGE_TO_IMAGE, ALL, "M", image=False, mask=False) == \
        [("image", "TASK_IMAGE_TO_IMAGE needs an image")]
    assert task_violations(T.TASK_INPAINT, ALL, "M", image=True, mask=False) == \
        [("mask_image", "TASK_INPAINT needs a mask")]
    assert task_violations(T.TASK_TEXT_TO_IMAGE, None, "", image=True, mask=True) == \
        [("image", "TASK_TEXT_TO_IMAGE takes no image"), ("mask_image", "TASK_TEXT_TO_IMAGE takes no mask")]
    assert task_violations(99, ALL, "M", image=False, mask=False) == [("task", "unknown task 99")]


def test_a_task_the_model_does_not_serve_names_what_was_sent() -> None:
    served = (T.TASK_TEXT_TO_IMAGE,)
    assert task_violations(T.TASK_EDIT, served, "M", image=True, mask=False) == \
        [("task", "M serves TASK_TEXT_TO_IMAGE, not TASK_EDIT")]
    # Chosen from the inputs, not asked for: the input the model cannot take is at fault.
    assert task_violations(T.TASK_IMAGE_TO_IMAGE, served, "M", image=True, mask=False, asked=False) == \
        [("image", "M cannot take an image (it serves TASK_TEXT_TO_IMAGE)")]
    assert task_violations(T.TASK_INPAINT, served + (T.TASK_IMAGE_TO_IMAGE,), "M", image=True, mask=True,
                           asked=False)[0][0] == "mask_image"
    assert task_violations(T.TASK_TEXT_TO_IMAGE, (T.TASK_EDIT,), "M", image=False, mask=False, asked=False) == \
        [("image", "M is an edit model: it needs an image to edit")]


@pytest.mark.parametrize(("task", "strength", "steps", "says"), [
    (T.TASK_IMAGE_TO_IMAGE, 0.5, 4, None),
    (T.TASK_INPAINT, 1.0, 1, None),
    (T.TASK_IMAGE_TO_IMAGE, 0.0, 4, "must be in (0, 1], got 0"),
    (T.TASK_IMAGE_TO_IMAGE, 1.5, 4, "must be in (0, 1], got 1.5"),
    (T.TASK_IMAGE_TO_IMAGE, math.nan, 4, "must be in (0, 1], got nan"),
    (T.TASK_IMAGE_TO_IMAGE, None, 4, "must be in (0, 1], got none"),
    (T.TASK_INPAINT, 0.05, 10, "0.05 of 10 steps runs none; raise it or num_inference_steps"),
    (T.TASK_TEXT_TO_IMAGE, None, 4, None),
    (T.TASK_EDIT, None, 4, None),
    (T.TASK_TEXT_TO_IMAGE, 0.5, 4, "TASK_TEXT_TO_IMAGE takes no strength"),
    (T.TASK_EDIT, 0.5, 4, "TASK_EDIT takes no strength"),
])
def test_strength_for_the_tasks_that_take_one(task: int, strength: float | None, steps: int,
                                              says: str | None) -> None:
    assert strength_problem(task, strength, steps) == says
