"""TaylorSeer on a transformer, with its schedule and Taylor factors kept per row.

TaylorSeer (Liu et al., 2025; diffusers' ``TaylorSeerCacheConfig``) computes the denoiser at some
steps and predicts it at the others by a Taylor series in the step: the features of the last computed
step and their divided differences over the computed steps before it. This is diffusers' lite mode
(``use_lite_mode=True``): every transformer block is skipped at a predicted step and the output
projection (``proj_out``, the denoiser's prediction before unpatchifying) is the predicted feature, so
a predicted step costs the embeddings and the final norm only. Its schedule: the first
``warmup_steps`` steps compute, then one step in ``interval`` (diffusers' ``disable_cache_before_step``
and ``cache_interval``), and a row's last step computes (diffusers' ``disable_cache_after_step`` at
the call's steps - 1: the last step decides the image's fine detail, 5-8 dB at 128 x 128 on
``shapes``, docs/acceleration.md); ``max_order`` 1, factors kept in the output's dtype. A single
image computes and predicts exactly as diffusers' hook does (tested against it).

diffusers keeps one state per call (``cache_context``) and counts steps per call, so a batch's rows
share one schedule and one set of factors. Under step-level batching a row is one request's image
at its own step: here every row (an image's guidance branch) has its own step count, interval and
factors. In one denoiser call the blocks run for the computing rows only (their per-row arguments
indexed, as ``RowCache`` does; the predicting rows pass through unchanged) and each predicting row's
output projection is replaced by its own prediction. A row joining late has no factors, so it
computes its warmup; it never reads another row's. A row's last step is its own: its caller gives
each row its denoiser calls left (``RowPlan.remaining``); a row whose count is not known (a pipeline
call of unknown steps) keeps the interval alone.

A row's setting is its request's threshold (else the model's) read as the interval, a whole number
of steps: 0 or 1 never predicts. Rows are named and their states kept and dropped as in every
per-row cache (``PerRowCache``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks._helpers import TransformerBlockMetadata
from diffusers.hooks.hooks import ModelHook

from runner_service.acceleration.compiled_blocks import padded, skip_hook_wrapper
from runner_service.acceleration.row_state import CallHook, PerRowCache, RowCall, RowState, eager, not_traced, original
from runner_service.acceleration.transformer_blocks import (
    block_metadata,
    blocks,
    has_described_blocks,
    on_rows,
)

_CALL_HOOK = "taylorseer_call"
_BLOCK_HOOK = "taylorseer_block"
_OUTPUT_HOOK = "taylorseer_output"
MAX_ORDER = 1  # diffusers' default: the features and their first divided difference


@dataclass
class _RowState(RowState):
    """One row's Taylor factors (order 0: its output at its last computed step; order j + 1: the
    divided difference of order j over its computed steps) and that step."""

    factors: list[torch.Tensor] = field(default_factory=list)
    last_computed: int | None = None

    def update(self, output: torch.Tensor) -> None:
        """The row's output at its current step (``steps - 1``), computed: diffusers' update."""
        step = self.steps - 1
        factors = [output]
        if self.last_computed is not None:
            delta = step - self.last_computed
            for order in range(min(MAX_ORDER, len(self.factors))):
                if self.factors[order].shape != factors[order].shape:
                    break
                factors.append((factors[order] - self.factors[order]) / delta)
        self.factors, self.last_computed = factors, step

    def predict(self) -> torch.Tensor:
        """The row's output at its current step from its factors: diffusers' prediction."""
        assert self.last_computed is not None  # a row without factors computes
        offset = self.steps - 1 - self.last_computed
        output = torch.zeros_like(self.factors[0])
        for order, factor in enumerate(self.factors):
            output = output + factor * (offset ** order / math.factorial(order))
        return output


@dataclass
class _Call(RowCall[_RowState]):
    """One denoiser call under way: its rows' intervals and the computing rows as an index."""

    intervals: list[int]
    index: torch.Tensor  # ``compute`` as an index tensor, padded (``compiled_blocks.padded``)


class TaylorSeerCache(PerRowCache[_RowState, _Call]):
    """``taylorseer`` on a transformer, per row; ``threshold`` is the model's interval and
    ``warmup_steps`` the computed steps every row starts with (a row's own interval comes with its
    call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser has transformer blocks diffusers describes and an output projection."""
        return has_described_blocks(denoiser) and isinstance(getattr(denoiser, "proj_out", None), torch.nn.Module)

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} has no described transformer blocks and proj_out")
        super().__init__(threshold, warmup_steps, _RowState)
        self._hook(denoiser, CallHook(self, "hidden_states"), _CALL_HOOK)
        for block in blocks(denoiser):
            metadata = block_metadata(block)
            assert metadata is not None  # supports() checked every block
            self._hook(block, _BlockHook(self, metadata), _BLOCK_HOOK)
            skip_hook_wrapper(block)
        projection = denoiser.proj_out
        assert isinstance(projection, torch.nn.Module)  # supports() checked it
        self._hook(projection, _OutputHook(self), _OUTPUT_HOOK)

    @eager
    def begin(self, hidden: torch.Tensor) -> _Call | None:
        """Starts a denoiser call on ``hidden`` and decides which rows compute: those without factors,
        in their warmup, with an interval below 2, at their schedule's computed step (diffusers':
        ``(step - warmup - 1) % interval == 0``) or at their last step. None when no call is planned
        (plain)."""
        planned = self._planned(hidden.shape[0])
        if planned is None:
            return None
        plans, states = planned
        intervals = [int(plan.setting) for plan in plans]
        compute = [index for index, (state, interval, plan) in enumerate(zip(states, intervals, plans, strict=True))
                   if self._computes(state, interval, plan.remaining)]
        self._advance(states, len(compute))
        self._call = _Call(states, compute, intervals,
                           torch.tensor(padded(compute, len(states)), dtype=torch.long, device=hidden.device))
        return self._call

    def _computes(self, state: _RowState, interval: int, remaining: int | None) -> bool:
        """Whether a row computes at this call; ``remaining`` <= 1 is its last step (diffusers'
        ``current_step >= disable_cache_after_step``, that step being the call's steps - 1)."""
        step = state.steps
        return (interval < 2 or state.last_computed is None or step < self.warmup_steps
                or (step - self.warmup_steps - 1) % interval == 0 or (remaining is not None and remaining <= 1))


class _BlockHook(ModelHook):
    """On every transformer block: runs it on the computing rows only; the predicting rows pass
    through unchanged (their output projection is replaced)."""

    def __init__(self, cache: TaylorSeerCache, metadata: TransformerBlockMetadata) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.metadata = metadata

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None:
            return original(self)(*args, **kwargs)
        return on_rows(original(self), self.metadata, args, kwargs, call.rows, call.compute, call.index)[0]


class _OutputHook(ModelHook):
    """On the output projection: updates each computing row's factors with its output and gives each
    predicting row its prediction."""

    def __init__(self, cache: TaylorSeerCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache

    @not_traced
    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        call = self.cache.call
        if call is None:
            return output
        computing = set(call.compute)
        for index in call.compute:
            if call.intervals[index] >= 2:  # a row that never predicts keeps nothing
                call.states[index].update(output[index:index + 1].clone())
        if len(computing) == call.rows:
            return output
        output = output.clone()
        for index in range(call.rows):
            if index not in computing:
                output[index] = call.states[index].predict()[0]
        return output
