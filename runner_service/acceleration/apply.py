"""Applies an ``AccelerationPlan`` to a loaded pipeline's denoiser, and says what a pipeline could
take on this platform (``AccelerationOffer``).

The denoiser is the pipeline's ``transformer`` or ``unet`` component. Each method is a library's:
torchao's weight-only quantization (``quantize_``), diffusers' attention dispatcher
(``set_attention_backend``), the step cache (diffusers' First Block Cache, cache-dit's DBCache or
TaylorSeer on a transformer, DeepCache on a UNet, each kept per row on diffusers' hooks) and
diffusers' regional compile (``compile_repeated_blocks``: each repeated block class is compiled once,
so the compile is a fraction of a whole-model one). They are applied in that order: the cache's hooks sit around or
inside the compiled blocks, and decide eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffusion.v1 import common_pb2
from runner_service.acceleration.compiled_blocks import compile_repeated_blocks
from runner_service.acceleration.row_cache import DualBlockCache, RowCache
from runner_service.acceleration.step_cache import StepCache
from runner_service.acceleration.taylorseer_cache import TaylorSeerCache
from runner_service.acceleration.unet_cache import UNetCache
from runner_service.platforms import Platform
from serving_common.errors import invalid_argument
from serving_common.input_rules import (
    DEEP_CACHE,
    DUAL_BLOCK_CACHE,
    FIRST_BLOCK_CACHE,
    FLOAT8_WEIGHT_ONLY,
    INT8_WEIGHT_ONLY,
    TAYLORSEER,
    AccelerationPlan,
)

logger = logging.getLogger(__name__)

DENOISERS = ("transformer", "unet")


def _int8_weight_only() -> object:
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


def _float8_weight_only() -> object:
    from torchao.quantization import Float8WeightOnlyConfig

    return Float8WeightOnlyConfig()


# Acceleration.quantization's names, each torchao's config for it.
QUANTIZATIONS: dict[str, Callable[[], object]] = {
    INT8_WEIGHT_ONLY: _int8_weight_only,
    FLOAT8_WEIGHT_ONLY: _float8_weight_only,
}

# Acceleration.cache's names, each the step cache that implements it (its ``supports`` says which
# denoisers take it).
CACHES: dict[str, type[RowCache] | type[UNetCache] | type[TaylorSeerCache]] = {
    FIRST_BLOCK_CACHE: RowCache, DEEP_CACHE: UNetCache, TAYLORSEER: TaylorSeerCache, DUAL_BLOCK_CACHE: DualBlockCache}


def denoiser_of(pipeline: DiffusionPipeline) -> torch.nn.Module | None:
    """The pipeline's denoiser, found by its component name."""
    for name in DENOISERS:
        module = pipeline.components.get(name)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def _torchao_installed() -> bool:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        return False
    return True


def _usable_backend(name: str) -> bool:
    """Whether diffusers' dispatcher has the backend and its package is installed."""
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (ValueError, RuntimeError):
        return False
    return True


def platform_offer(platform: Platform) -> common_pb2.AccelerationOffer:
    """What some model could be loaded with here: checked before a model is replaced."""
    return common_pb2.AccelerationOffer(
        cache_methods=list(CACHES),
        quantizations=list(platform.quantizations()) if _torchao_installed() else [],
        attention_backends=[name for name in platform.attention_backends if _usable_backend(name)],
        compile=platform.compiles())


def quantize(module: torch.nn.Module, quantization: str) -> None:
    """Quantizes the module's linear weights in place (torchao), as ``quantization`` names."""
    from torchao.quantization import quantize_

    quantize_(module, QUANTIZATIONS[quantization]())


def offer(pipeline: DiffusionPipeline, platform: Platform) -> common_pb2.AccelerationOffer:
    """What the pipeline's denoiser could be loaded with here: the platform's offer, less what its
    family cannot take (the First Block Cache needs transformer blocks diffusers describes, the Dual
    Block Cache more of them than its front and back blocks, TaylorSeer those and an output
    projection, DeepCache a UNet, a backend the dispatcher, compile repeated blocks)."""
    denoiser = denoiser_of(pipeline)
    if denoiser is None:
        return common_pb2.AccelerationOffer()
    offered = platform_offer(platform)
    dispatched = any(isinstance(module, AttentionModuleMixin) for module in denoiser.modules())
    return common_pb2.AccelerationOffer(
        cache_methods=[name for name in offered.cache_methods if CACHES[name].supports(denoiser)],
        quantizations=offered.quantizations,
        attention_backends=offered.attention_backends if dispatched else [],
        compile=offered.compile and bool(getattr(denoiser, "_repeated_blocks", None)))


def check(plan: AccelerationPlan, offered: common_pb2.AccelerationOffer, model: str) -> None:
    """INVALID_ARGUMENT naming each field of the plan that ``offered`` does not have."""
    violations = {}
    for field, asked, names in (("cache", plan.cache, offered.cache_methods),
                                ("quantization", plan.quantization, offered.quantizations),
                                ("attention_backend", plan.attention_backend, offered.attention_backends)):
        if asked and asked not in names:
            violations[f"acceleration.{field}"] = (
                f"{model} cannot take {asked!r} here; offered: {', '.join(names) or 'none'}")
    if plan.compile and not offered.compile:
        violations["acceleration.compile"] = f"{model} cannot be compiled here (no repeated blocks or no compiler)"
    if violations:
        raise invalid_argument(violations)


def accelerate(pipeline: DiffusionPipeline, plan: AccelerationPlan, platform: Platform) -> StepCache | None:
    """Applies ``plan`` to the pipeline's denoiser in place (after checking it against ``offer``);
    returns the step cache when the plan has one."""
    if plan.plain:
        return None
    check(plan, offer(pipeline, platform), type(pipeline).__name__)
    denoiser = denoiser_of(pipeline)
    assert denoiser is not None  # the offer of a pipeline without one is empty
    if plan.quantization:
        quantize(denoiser, plan.quantization)
    if plan.attention_backend:
        denoiser.set_attention_backend(plan.attention_backend)  # type: ignore[operator]
    cache = CACHES[plan.cache](denoiser, plan.cache_threshold, plan.cache_warmup_steps) if plan.cache else None
    if plan.compile:
        compile_repeated_blocks(denoiser)
    logger.info("accelerated %s: %s", type(pipeline).__name__, plan)
    return cache
