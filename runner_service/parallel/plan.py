"""What a runner group is asked to do with its ranks, and whether the loaded model can take it.

The plan comes from the ``Parallelism`` message of Init or LoadModel. It is checked against the
pipeline before anything is applied, so a combination that cannot work is refused with the name of
the field at fault instead of failing (or silently computing something else) mid-generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffusion.v1 import common_pb2
from runner_service.families import FAMILIES, family_of
from runner_service.families.record import CfgBranches
from serving_common.errors import ServiceError, invalid_argument
from serving_common.protocol import normal_parallel


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
        """In the protocol's normal form (degrees of 1 as unset), as the worker keeps what it asked."""
        return normal_parallel(common_pb2.Parallelism(
            cfg=self.cfg, ulysses_degree=self.ulysses_degree, ring_degree=self.ring_degree))

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg else 1

    @property
    def context_degree(self) -> int:
        """Ranks that share one sequence (diffusers' ring x ulysses mesh)."""
        return self.ulysses_degree * self.ring_degree

    def size_multiple(self, multiple: int) -> int:
        """What widths and heights must be multiples of under this plan, for a model whose own
        multiple (one latent patch) is ``multiple``: diffusers' context-parallel split needs the
        sequence to divide evenly over the ranks, which a side of whole multiples of the degree
        in patches ensures."""
        return multiple * self.context_degree

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: one context-parallel mesh per guidance branch."""
        return self.cfg_degree * self.context_degree


# The pipelines whose family record says how parallel CFG splits its guidance branches (``Family.cfg``).
_CFG_SPLIT = sorted(family.pipeline_class for family in FAMILIES.values() if family.cfg is not None)


def cfg_branches(pipeline: DiffusionPipeline) -> CfgBranches | None:
    """How parallel CFG splits the pipeline's guidance branches, as its family's record says; None
    where it cannot (a family not read and tested for it, or a pipeline of no family)."""
    family = family_of(pipeline)
    return family.cfg if family is not None else None


def denoiser_of(pipeline: DiffusionPipeline) -> torch.nn.Module | None:
    """The module the denoising loop calls each step (a DiT's transformer or a UNet)."""
    for name in ("transformer", "unet"):
        module = getattr(pipeline, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def world_violations(plan: ParallelPlan, world_size: int) -> list[str]:
    """Whether the plan needs as many ranks as the group has (checked before anything loads)."""
    if plan.world_size == world_size:
        return []
    has = f"the group has {world_size}" if world_size > 1 else "this runner has one device (see --devices)"
    return [
        f"parallel.ulysses_degree {plan.ulysses_degree} x parallel.ring_degree {plan.ring_degree}"
        f"{' x 2 (parallel.cfg)' if plan.cfg else ''} = {plan.world_size} ranks, but {has}"
    ]


def refusal(violations: list[str]) -> ServiceError:
    """INVALID_ARGUMENT for ``check``'s or ``world_violations``' reasons, each under the field it names."""
    fields = {reason.split(":")[0].split(" ")[0]: reason for reason in violations}
    return invalid_argument(fields, "; ".join(violations))


def check(plan: ParallelPlan, pipeline: DiffusionPipeline, world_size: int) -> list[str]:
    """Every reason the plan cannot run on this pipeline in a group of ``world_size`` ranks, each
    naming its field; empty when it can."""
    violations = world_violations(plan, world_size)
    if getattr(pipeline, "transformer_2", None) is not None and plan.world_size > 1:
        # Wan 2.2 swaps denoisers mid-loop; only ``transformer`` would be split.
        violations.append("parallel: a pipeline with a second denoiser (transformer_2) runs on one device only")
    if plan.cfg and cfg_branches(pipeline) is None:
        violations.append(
            f"parallel.cfg: {type(pipeline).__name__} has no classifier-free guidance with two branches that this "
            f"runner can split (supported: {', '.join(_CFG_SPLIT)})"
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
