"""What the clients refuse before sending a GenerateRequest: the values the worker refuses whatever
its flags and its model, checked by the rules it applies (``serving_common.input_rules``).

A refusal is the ``InvalidArgument`` the worker would answer, one violation per field named as in
the GenerateRequest (``num_inference_steps`` for ``steps``), not a protobuf ValueError for a seed
of -1 nor the worker's default for ``steps=0``. Bounds that are the worker's flags or the model's
(the most steps, the size grid, the largest guidance) are the worker's to check.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from clients.errors import refusal
from diffusion.v1 import common_pb2
from serving_common.generation_params import GenerationParams
from serving_common.input_rules import (
    MAX_FLOAT32,
    MAX_UINT32,
    Violation,
    adapter_name_problem,
    adapter_scale_problem,
    guidance_problem,
    request_id_problem,
    seed_problem,
    set_count_problem,
    strength_problem,
)

# The longest request id is the worker's flag, not known here: only its characters are checked. The
# largest scales are the worker's flags too (--max-guidance, --max-adapter-scale): here the most a
# float field carries.
_ANY_LENGTH = sys.maxsize


def check_generate(*, counts: Mapping[str, int | None], seed: int | None, scales: Mapping[str, float | None],
                   ruled: Mapping[str, float | None], strength: float | None,
                   adapters: Sequence[common_pb2.AdapterRef], request_id: str) -> None:
    """Raises ``InvalidArgument`` naming each value refused. ``counts``: the counts and sizes set (None:
    unset), by field; ``scales``: guidance_scale and true_cfg_scale (None: unset); ``ruled``: the
    fields declared with a model rule (``GenerationParams.model_violations``, on no model known), by
    field (None: unset); ``adapters`` as built."""
    violations: list[Violation] = [(field, problem) for field, value in counts.items()
                                   if value is not None and (problem := set_count_problem(value)) is not None]
    if seed is not None and (problem := seed_problem(seed)) is not None:
        violations.append(("seed", problem))
    violations += [(field, problem) for field, scale in scales.items()
                   if scale is not None and (problem := guidance_problem(scale, MAX_FLOAT32)) is not None]
    violations += GenerationParams.model_violations(ruled, None)
    if strength is not None:
        # Outside (0, 1] a strength is refused whatever the task (one that takes none refuses any), so
        # image-to-image's rule holds; with the steps unset (or refused) only its range is checked.
        steps = counts.get("num_inference_steps")
        steps = steps if steps is not None and set_count_problem(steps) is None else MAX_UINT32
        if (problem := strength_problem(common_pb2.TASK_IMAGE_TO_IMAGE, strength, steps)) is not None:
            violations.append(("strength", problem))
    for index, ref in enumerate(adapters):
        if (problem := adapter_name_problem(ref.name)) is not None:
            violations.append((f"adapters[{index}].name", problem))
        if ref.HasField("scale") and (problem := adapter_scale_problem(ref.scale, MAX_FLOAT32)) is not None:
            violations.append((f"adapters[{index}].scale", problem))
    if request_id and (problem := request_id_problem(request_id, _ANY_LENGTH)) is not None:
        violations.append(("request_id", problem))
    if violations:
        raise refusal(violations)
