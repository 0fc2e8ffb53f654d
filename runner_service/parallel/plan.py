"""What a runner group is asked to do with its ranks, and whether the loaded model can take it.

The plan comes from the ``Parallelism`` message of Init or LoadModel. It is checked against the
pipeline before anything is applied, so a combination that cannot work is refused with the name of
the field at fault instead of failing (or silently computing something else) mid-generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffusion.v1 import common_pb2


class CfgLayout(Enum):
    """Where the two guidance branches meet the denoiser in a family's pipeline ``__call__``."""

    # One call whose rows are [unconditional; conditional] (``torch.cat([latents] * 2)``): each
    # CFG rank computes its half of the rows.
    ROWS = "rows"
    # Two calls per step, the conditional one first (Flux's true CFG, Wan): each CFG rank computes
    # one of the two calls.
    CALLS = "calls"


# The families whose guidance layout was read in diffusers 0.42's pipelines and is tested on two
# ranks (tests/test_parallel_modes.py). Others are refused for ``parallel.cfg`` until they are.
CFG_LAYOUTS: dict[str, CfgLayout] = {
    "StableDiffusion3Pipeline": CfgLayout.ROWS,  # pipeline_stable_diffusion_3.py: torch.cat([latents] * 2)
    "FluxPipeline": CfgLayout.CALLS,  # pipeline_flux.py: transformer(...) then, for true CFG, again
    "WanPipeline": CfgLayout.CALLS,  # pipeline_wan.py: the "cond" then the "uncond" call
}


@dataclass(frozen=True)
class ParallelPlan:
    """The parallel modes of one runner group; the degrees are 1 where a mode is off."""

    cfg: bool = False
    ulysses_degree: int = 1
    ring_degree: int = 1

    @classmethod
    def from_proto(cls, message: common_pb2.Parallelism) -> ParallelPlan:
        """The proto says 0 or 1 for "none"; the plan keeps 1 so the degrees multiply."""
        return cls(
            cfg=message.cfg,
            ulysses_degree=max(message.ulysses_degree, 1),
            ring_degree=max(message.ring_degree, 1),
        )

    def to_proto(self) -> common_pb2.Parallelism:
        return common_pb2.Parallelism(
            cfg=self.cfg, ulysses_degree=self.ulysses_degree, ring_degree=self.ring_degree
        )

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg else 1

    @property
    def context_degree(self) -> int:
        """Ranks that share one sequence (diffusers' ring x ulysses mesh)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: one context-parallel mesh per guidance branch."""
        return self.cfg_degree * self.context_degree


def denoiser_of(pipeline: DiffusionPipeline) -> torch.nn.Module | None:
    """The module the denoising loop calls each step (a DiT's transformer or a UNet)."""
    for name in ("transformer", "unet"):
        module = getattr(pipeline, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def check(plan: ParallelPlan, pipeline: DiffusionPipeline, world_size: int) -> list[str]:
    """Every reason the plan cannot run on this pipeline in a group of ``world_size`` ranks, each
    naming its field; empty when it can."""
    violations: list[str] = []
    if plan.world_size != world_size:
        violations.append(
            f"parallel.ulysses_degree {plan.ulysses_degree} x parallel.ring_degree {plan.ring_degree}"
            f"{' x 2 (parallel.cfg)' if plan.cfg else ''} = {plan.world_size} ranks, but the group has {world_size}"
        )
    if getattr(pipeline, "transformer_2", None) is not None and plan.world_size > 1:
        # Wan 2.2 swaps denoisers mid-loop; only ``transformer`` would be split.
        violations.append("parallel: a pipeline with a second denoiser (transformer_2) runs on one device only")
    pipeline_class = type(pipeline).__name__
    if plan.cfg and pipeline_class not in CFG_LAYOUTS:
        violations.append(
            f"parallel.cfg: {pipeline_class} has no classifier-free guidance with two branches that this "
            f"runner can split (supported: {', '.join(sorted(CFG_LAYOUTS))})"
        )
    if plan.context_degree > 1:
        violations.extend(_context_violations(plan, pipeline))
    return violations


def _context_violations(plan: ParallelPlan, pipeline: DiffusionPipeline) -> list[str]:
    """Context parallelism needs diffusers' own split plan (``_cp_plan``) for the denoiser, and
    Ulysses hands each rank whole attention heads."""
    field = "parallel.ulysses_degree" if plan.ulysses_degree > 1 else "parallel.ring_degree"
    denoiser = denoiser_of(pipeline)
    if denoiser is None or getattr(denoiser, "_cp_plan", None) is None:
        name = type(denoiser).__name__ if denoiser is not None else "no transformer"
        return [f"{field}: diffusers has no context-parallel plan for {name}"]
    if plan.ring_degree > 1:
        backend = _attention_backend(denoiser)
        if backend in _WITHOUT_LSE:
            return [
                f"parallel.ring_degree: ring attention needs the log-sum-exp of each block, which diffusers' "
                f"{backend.value!r} attention backend does not return (on CPU only 'native' runs)"
            ]
    if plan.ulysses_degree > 1:
        heads = getattr(getattr(denoiser, "config", None), "num_attention_heads", None)
        if not isinstance(heads, int):
            return [f"parallel.ulysses_degree: {type(denoiser).__name__} does not say its attention heads"]
        if heads % plan.ulysses_degree:
            return [
                f"parallel.ulysses_degree: {plan.ulysses_degree} does not divide the {heads} attention heads "
                f"of {type(denoiser).__name__}"
            ]
    return []


# diffusers 0.42's backends that raise on ``return_lse=True`` (attention_dispatch.py), which its
# ring attention asks for: "Native attention does not support return_lse=True".
_WITHOUT_LSE = frozenset({
    AttentionBackendName.NATIVE,
    AttentionBackendName._NATIVE_EFFICIENT,
    AttentionBackendName._NATIVE_MATH,
    AttentionBackendName._NATIVE_NPU,
    AttentionBackendName.XFORMERS,
})


def _attention_backend(denoiser: torch.nn.Module) -> AttentionBackendName:
    """The backend the denoiser's attention dispatches to, found as ``enable_parallelism`` does:
    the first processor's own, else the process-wide active one."""
    for module in denoiser.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            if processor._attention_backend is not None:
                return AttentionBackendName(processor._attention_backend)
            break
    backend, _ = _AttentionBackendRegistry.get_active_backend()  # type: ignore[no-untyped-call]  # diffusers: untyped
    return AttentionBackendName(backend)
