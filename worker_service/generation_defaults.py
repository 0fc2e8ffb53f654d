"""The defaults in force for a request that leaves a field unset: the loaded model's own
(``ModelInfo.defaults``, its generation_config.json), else the worker's flags.

Guidance goes further down, so that a model without a file still gets what suits its family: the
model's file, else ``--default-guidance`` when given, else the family's default the runner reports
(``capabilities.default_guidance_scale``: SD 7.5, Flux 3.5), else ``FALLBACK_GUIDANCE``; a model
that takes no guidance (``GUIDANCE_KIND_NONE``) gets 0 whatever is set. Sizes are put on the model's
size grid. ``normalize`` fills requests in with these, and GetStatus shows them.
"""

from __future__ import annotations

from diffusion.v1 import common_pb2
from serving_common.input_rules import SizeGrid
from worker_service.config import FALLBACK_GUIDANCE, Limits


def size_grid(model: common_pb2.ModelInfo | None, limits: Limits) -> SizeGrid:
    """The sizes ``model`` takes (None: none loaded), within the worker's ``--min-size`` and ``--max-size``."""
    reported = (model.size_multiple, model.min_size, model.max_size) if model is not None else (0, 0, 0)
    return SizeGrid.of(*reported, floor=limits.min_size, ceiling=limits.max_size)


def defaults_in_force(model: common_pb2.ModelInfo | None, limits: Limits) -> common_pb2.GenerationDefaults:
    """What an unset num_inference_steps, guidance_scale, width and height become for ``model``
    (None: none loaded)."""
    own = model.defaults if model is not None else common_pb2.GenerationDefaults()
    grid = size_grid(model, limits)
    return common_pb2.GenerationDefaults(
        num_inference_steps=own.num_inference_steps or limits.default_steps,
        guidance_scale=_guidance(model, own, limits),
        width=grid.default(own.width or limits.default_size),
        height=grid.default(own.height or limits.default_size))


def _guidance(model: common_pb2.ModelInfo | None, own: common_pb2.GenerationDefaults, limits: Limits) -> float:
    capabilities = model.capabilities if model is not None and model.HasField("capabilities") else None
    if capabilities is not None and capabilities.guidance == common_pb2.GUIDANCE_KIND_NONE:
        return 0.0
    if own.HasField("guidance_scale"):
        return own.guidance_scale
    if limits.default_guidance is not None:
        return limits.default_guidance
    if capabilities is not None and capabilities.default_guidance_scale:
        return capabilities.default_guidance_scale
    return FALLBACK_GUIDANCE
