"""Applies a checked ``ParallelPlan`` to the pipeline each rank of a torch.distributed group loaded.

Every rank runs the whole pipeline ``__call__`` with the same seed, so the text encoders, the
scheduler and the VAE compute the same values everywhere; only the denoiser's calls are shared out:

- context parallelism is diffusers' own (``ContextParallelConfig`` through
  ``enable_parallelism``): its hooks split the sequence over the ``ring`` x ``ulysses`` mesh and
  gather it back at the transformer's output;
- CFG-parallel wraps the denoiser's ``forward``: each of the two CFG ranks computes one guidance
  branch and the branches are exchanged with one ``all_gather``, so every rank continues with the
  full output, identical to the single-device one.

Rank layout: rank = cfg_rank x (ring x ulysses) + context rank, i.e. the device mesh
``(cfg, ring, ulysses)``; the CFG group pairs the ranks that hold the same slice of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runner_service.families.record import CfgLayout
from runner_service.parallel.plan import ParallelPlan, cfg_branches, check, denoiser_of


@dataclass(frozen=True)
class ParallelRun:
    """A pipeline with a plan applied: what each generation enters (``request``)."""

    plan: ParallelPlan
    split: CfgSplit | None  # None without CFG-parallel
    scale: str = ""  # the call argument whose value above 1 makes a request guided (CfgBranches.scale)

    def guided(self, scales: Mapping[str, float]) -> bool:
        """Whether a pipeline call given these guidance arguments (``PipelineAdapter.scales``) runs
        both guidance branches each step; an argument it is not given keeps the pipeline's default,
        which is off for the one that turns the second branch on (Flux's ``true_cfg_scale`` 1)."""
        return scales.get(self.scale, 0.0) > 1

    def request(self, guided: bool) -> AbstractContextManager[None]:
        """One pipeline call; ``guided``: it computes both guidance branches each step."""
        return self.split.request(guided) if self.split is not None else nullcontext()


def apply(plan: ParallelPlan, pipeline: DiffusionPipeline, device: torch.device) -> ParallelRun:
    """Applies ``plan`` on this rank (every rank calls it, in the same order: it builds process
    groups). Returns what each generation must enter. Raises ValueError naming the fields when
    ``check`` refuses the plan."""
    violations = check(plan, pipeline, dist.get_world_size())
    if violations:
        raise ValueError("; ".join(violations))
    denoiser = denoiser_of(pipeline)
    assert denoiser is not None  # check() refuses a pipeline without one for either mode
    mesh = init_device_mesh(
        device.type,
        (plan.cfg_degree, plan.ring_degree, plan.ulysses_degree),
        mesh_dim_names=("cfg", "ring", "ulysses"),
    )
    if plan.context_degree > 1:
        _enable_context_parallel(denoiser, plan, mesh["ring", "ulysses"], device)
    if not plan.cfg:
        return ParallelRun(plan, None)
    cfg_mesh = mesh["cfg"]
    branches = cfg_branches(pipeline)
    assert branches is not None  # check() refuses parallel.cfg for a pipeline without
    split = CfgSplit(denoiser, branches.layout, cfg_mesh.get_group(), cfg_mesh.get_local_rank())
    return ParallelRun(plan, split, branches.scale)


def _enable_context_parallel(
    denoiser: torch.nn.Module, plan: ParallelPlan, mesh: DeviceMesh, device: torch.device
) -> None:
    """diffusers' ``enable_parallelism`` with the group's own mesh and device.

    Its ``_resolve_parallel_config`` picks the device as ``rank % torch.accelerator.device_count()``,
    which divides by zero on CPU (gloo ranks) and ignores the platform's device choice, so for this
    one call the model resolves the config with the device and mesh given here; everything else
    (attention processors, the split/gather hooks of ``_cp_plan``) is diffusers' code."""
    config = ContextParallelConfig(ulysses_degree=plan.ulysses_degree, ring_degree=plan.ring_degree, mesh=mesh)

    def resolve(given: ContextParallelConfig) -> ParallelConfig:
        resolved = ParallelConfig(context_parallel_config=given)
        resolved.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        denoiser._parallel_config = resolved  # type: ignore[assignment]  # nn.Module types attributes as modules
        return resolved

    denoiser._resolve_parallel_config = resolve  # type: ignore[assignment]  # this instance only, undone below
    try:
        denoiser.enable_parallelism(config=config)  # type: ignore[operator]
    finally:
        del denoiser._resolve_parallel_config


class CfgSplit:
    """Shares the two guidance branches of each denoising step between the two CFG ranks.

    Whether a request has two branches is the caller's to say (``request``): Flux's true CFG
    depends on a negative prompt and ``true_cfg_scale``, which the transformer never sees."""

    def __init__(
        self, denoiser: torch.nn.Module, layout: CfgLayout, group: dist.ProcessGroup, cfg_rank: int
    ) -> None:
        self._forward: Callable[..., Any] = denoiser.forward
        self._layout = layout
        self._group = group
        self._rank = cfg_rank
        self._guided = False
        # CALLS layout: between a step's conditional and unconditional calls, this rank's
        # conditional output (CFG rank 0) or the empty tensor it returned in its place (rank 1),
        # and the call's timestep.
        self._held: tuple[torch.Tensor, Any] | None = None
        denoiser.forward = self._call

    @contextmanager
    def request(self, guided: bool) -> Iterator[None]:
        """One pipeline call; ``guided``: it computes both guidance branches each step."""
        self._guided = guided
        self._held = None
        try:
            yield
        finally:
            self._guided = False
            left, self._held = self._held, None
        if left is not None:
            raise RuntimeError("parallel.cfg: the pipeline made a conditional call without its unconditional one")

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if not self._guided:
            return self._forward(*args, **kwargs)
        if kwargs.get("return_dict", True):
            raise RuntimeError("parallel.cfg: the denoiser was called with return_dict=True; only tuples are split")
        if self._layout is CfgLayout.ROWS:
            return self._rows(args, kwargs)
        return self._calls(args, kwargs)

    def _gather(self, own: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(own) for _ in range(2)]
        dist.all_gather(parts, own.contiguous(), group=self._group)
        return parts

    def _rows(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """One call holds both branches as rows: this rank computes its half, then the halves meet."""
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        rows = hidden.shape[0]
        if rows % 2:
            raise RuntimeError(f"parallel.cfg: a guided call has {rows} rows, not two halves")
        half = rows // 2
        start = self._rank * half

        def take(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == rows:
                return value[start : start + half]
            if isinstance(value, dict):
                return {key: take(item) for key, item in value.items()}
            return value

        output = self._forward(*(take(arg) for arg in args), **{key: take(item) for key, item in kwargs.items()})
        return (torch.cat(self._gather(output[0])), *output[1:])

    def _calls(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The pipeline calls the conditional branch, then the unconditional one, and only then
        combines them. CFG rank 0 computes the first call and rank 1 the second; at the second call
        the outputs are exchanged, and rank 1 fills the (so far empty) tensor it returned for the
        first, which its pipeline still holds unread."""
        timestep = kwargs.get("timestep")
        if self._held is None:
            if self._rank == 0:
                output = self._forward(*args, **kwargs)
                self._held = (output[0], timestep)
                return tuple(output)
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            stand_in = torch.empty(0, dtype=hidden.dtype, device=hidden.device)
            self._held = (stand_in, timestep)
            return (stand_in,)
        held, held_timestep = self._held
        self._held = None
        if not _same(timestep, held_timestep):
            raise RuntimeError("parallel.cfg: two conditional calls in a row (the unconditional call never came)")
        own = held if self._rank == 0 else self._forward(*args, **kwargs)[0]
        conditional, unconditional = self._gather(own)
        if self._rank == 1:
            if conditional.dtype != held.dtype:
                raise RuntimeError(
                    f"parallel.cfg: the denoiser returns {conditional.dtype} for {held.dtype} latents"
                )
            held.resize_(conditional.shape).copy_(conditional)
        return (unconditional,)


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return first.shape == second.shape and bool(torch.equal(first, second))
    return bool(first == second)
