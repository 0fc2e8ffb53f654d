"""First Block Cache and cache-dit's Dual Block Cache, with their decisions and cached residuals kept
per row.

diffusers' First Block Cache (``diffusers.hooks.first_block_cache``) runs the denoiser's first
transformer block at every step and compares its residual (output minus input) with the one of the
last step that ran in full: when the relative mean change is below the threshold, the remaining
blocks are skipped and their residual from that step is added instead. cache-dit's DBCache (Dual
Block Cache) generalises it: the first ``Fn`` blocks always run and their residual is compared, the
middle blocks are skipped or run, and the last ``Bn`` blocks always run, on the middle's output or on
the front's output plus the middle's cached residual (the First Block Cache is its F1B0). Both keep
one state per call and decide for the whole batch at once, so a batch's rows share one decision and
one residual. Under step-level batching a row is one request's image at its own step, next to others
at theirs: here every row (an image's guidance branch) has its own state, its own decision and its
own threshold (its request's, else the model's; 0 never skips).

A step computes the middle blocks only for the rows that need them: each runs on those rows (the
tensor arguments whose first dimension is the batch's rows are indexed; tuples such as rotary
embeddings are shared) while the skipping rows pass through it with their cached result; the front
and back blocks run every row. A single image decides exactly as diffusers' hook (F1B0) and
cache-dit's DBCache do (tested against both).

Rows are named and their states kept and dropped as in every per-row cache (``PerRowCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks._helpers import TransformerBlockMetadata
from diffusers.hooks.hooks import HookRegistry, ModelHook

from runner_service.acceleration.compiled_blocks import contiguous, padded, skip_hook_wrapper
from runner_service.acceleration.row_state import (
    ContextHook,
    PerRowCache,
    RowCall,
    RowState,
    eager,
    not_traced,
    original,
)
from runner_service.acceleration.transformer_blocks import (
    block_metadata,
    blocks,
    has_described_blocks,
    join,
    on_rows,
    split,
)

_HEAD_HOOK = "row_cache_head"
_BLOCK_HOOK = "row_cache_block"

# dual_block_cache's front (Fn) and back (Bn) blocks, fixed. On shapes (6 blocks) every split from
# F1B1 to F2B1 drew the same within 1.6 dB at the same share of rows skipped; F1B1 is the smallest
# split with a back block (docs/acceleration.md#cache-dits-dbcache-per-row-dual_block_cache).
DUAL_FRONT_BLOCKS, DUAL_BACK_BLOCKS = 1, 1


@dataclass
class _RowState(RowState):
    """One row's cache: the front blocks' residual and the middle blocks' residuals (hidden and
    encoder states) of its last full step."""

    head_residual: torch.Tensor | None = None
    tail_residuals: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class _Call(RowCall[_RowState]):
    """One denoiser call under way: its rows' thresholds, the first block's input, and the front
    blocks' output for the computing rows (the middle's residuals are measured from it)."""

    thresholds: list[float]
    front_input: torch.Tensor
    compute_index: torch.Tensor | None = None  # ``compute`` as an index tensor, for the blocks to select by
    head_hidden: torch.Tensor | None = None
    head_encoder: torch.Tensor | None = None


class RowCache(PerRowCache[_RowState, _Call]):
    """A residual cache on a denoiser, per row: the first ``front_blocks`` blocks decide, the last
    ``back_blocks`` always run (``first_block_cache``: 1 and 0). ``threshold`` and ``warmup_steps``
    are the model's (a row's own threshold comes with its call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module, front_blocks: int = 1, back_blocks: int = 0) -> bool:
        """Whether the denoiser's transformer blocks are all described by diffusers, and are enough
        for the front, the back and at least one middle block to skip."""
        return has_described_blocks(denoiser) and len(blocks(denoiser)) > front_blocks + back_blocks

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int,
                 front_blocks: int = 1, back_blocks: int = 0) -> None:
        if front_blocks < 1 or back_blocks < 0:
            raise ValueError(f"front_blocks must be >= 1 and back_blocks >= 0, got {front_blocks}, {back_blocks}")
        if not has_described_blocks(denoiser):
            raise ValueError(f"{type(denoiser).__name__} has no transformer blocks diffusers describes")
        found = blocks(denoiser)
        if len(found) <= front_blocks + back_blocks:
            raise ValueError(f"{type(denoiser).__name__} has {len(found)} transformer blocks: too few for "
                             f"{front_blocks} front, {back_blocks} back and a middle one")
        super().__init__(threshold, warmup_steps, _RowState)
        middle_end = len(found) - back_blocks
        for index, block in enumerate(found[:middle_end]):
            metadata = block_metadata(block)
            assert metadata is not None  # supports() checked every block
            if index < front_blocks:
                if index not in (0, front_blocks - 1):
                    continue  # a front block between the first and the last runs as it is
                self._hook(block, _HeadHook(self, metadata, starts=index == 0, decides=index == front_blocks - 1),
                           _HEAD_HOOK)
            else:
                self._hook(block, _BlockHook(self, metadata, tail=index == middle_end - 1), _BLOCK_HOOK)
            skip_hook_wrapper(block)
        # The pipeline's cache_context reaches the head hook through the denoiser's registry, which
        # keeps the list of registries under it from its first cache_context: one made before these
        # hooks (a plain call first) would leave the guidance branches unnamed, sharing one state.
        HookRegistry.check_if_exists_or_initialize(denoiser).invalidate_child_registries_cache()

    @eager
    def begin(self, hidden: torch.Tensor) -> _Call | None:
        """Starts a denoiser call whose first block's input is ``hidden``, every row computing until
        ``decide``."""
        rows = hidden.shape[0]
        planned = self._planned(rows)
        if planned is None:
            self._call = None
            return None
        plans, states = planned
        self._call = _Call(states, list(range(rows)), [plan.setting for plan in plans], hidden)
        return self._call

    @eager
    def decide(self, call: _Call, residual: torch.Tensor) -> list[int]:
        """The rows of ``call`` that run the middle blocks: those in their warmup, without a cached
        step, with threshold 0 or whose front residual changed by more than their threshold
        (diffusers' and cache-dit's measure: mean |residual - previous| / mean |previous|, here per
        row)."""
        states = call.states
        cached = [index for index, state in enumerate(states)
                  if state.tail_residuals is not None and state.head_residual is not None
                  and call.thresholds[index] > 0 and state.steps >= self.warmup_steps]
        skip: set[int] = set()
        if cached:
            current = residual[cached].flatten(1)
            previous = torch.cat([states[index].head_residual for index in cached]).flatten(1)  # type: ignore[misc]
            change = ((current - previous).abs().mean(1) / previous.abs().mean(1)).tolist()
            skip = {index for index, value in zip(cached, change, strict=True) if value <= call.thresholds[index]}
        self._advance(states, call.rows - len(skip))
        return [index for index in range(call.rows) if index not in skip]


class DualBlockCache(RowCache):
    """``dual_block_cache``: the row cache with ``DUAL_FRONT_BLOCKS`` front and ``DUAL_BACK_BLOCKS``
    back blocks."""

    @staticmethod
    def supports(denoiser: torch.nn.Module, front_blocks: int = DUAL_FRONT_BLOCKS,
                 back_blocks: int = DUAL_BACK_BLOCKS) -> bool:
        return RowCache.supports(denoiser, front_blocks, back_blocks)

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        super().__init__(denoiser, threshold, warmup_steps, DUAL_FRONT_BLOCKS, DUAL_BACK_BLOCKS)


class _HeadHook(ContextHook):
    """On the first front block: starts the call. On the last (the same block for one front block):
    decides per row, and gives the skipping rows their cached result."""

    def __init__(self, cache: RowCache, metadata: TransformerBlockMetadata, starts: bool, decides: bool) -> None:
        super().__init__(cache.context)
        self.cache = cache
        self.metadata = metadata
        self.starts = starts
        self.decides = decides

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        metadata = self.metadata
        output = original(self)(*args, **kwargs)
        call = (self.cache.begin(metadata._get_parameter_from_args_kwargs(
            metadata.hidden_states_argument_name, args, kwargs)) if self.starts else self.cache.call)
        if call is None or not self.decides:
            return output
        hidden, encoder = split(output, metadata)
        residual = hidden - call.front_input
        call.compute = self.cache.decide(call, residual)
        for index in call.compute:
            call.states[index].head_residual = residual[index:index + 1].clone()
        rows = call.compute_index = torch.tensor(padded(call.compute, call.rows), dtype=torch.long,
                                                 device=hidden.device)
        call.head_hidden = hidden.index_select(0, rows)
        call.head_encoder = None if encoder is None else encoder.index_select(0, rows)
        if len(call.compute) == call.rows:
            return contiguous(output)
        skipped = sorted(set(range(call.rows)) - set(call.compute))
        hidden, encoder = hidden.clone(), None if encoder is None else encoder.clone()
        for index in skipped:
            tail_hidden, tail_encoder = call.states[index].tail_residuals  # type: ignore[misc]
            hidden[index] += tail_hidden[0]
            if encoder is not None and tail_encoder is not None:
                encoder[index] += tail_encoder[0]
        return contiguous(join(output, metadata, hidden, encoder))


class _BlockHook(ModelHook):
    """On every middle block: runs it on the computing rows only; the last one also keeps each
    computing row's residual over the middle blocks."""

    def __init__(self, cache: RowCache, metadata: TransformerBlockMetadata, tail: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.metadata = metadata
        self.tail = tail

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None:
            return original(self)(*args, **kwargs)
        output, computed = on_rows(original(self), self.metadata, args, kwargs, call.rows, call.compute,
                                   call.compute_index)
        if self.tail and computed is not None:
            computed_hidden, computed_encoder = split(computed, self.metadata)
            assert call.head_hidden is not None
            hidden_residual = computed_hidden - call.head_hidden
            encoder_residual = (None if computed_encoder is None or call.head_encoder is None
                                else computed_encoder - call.head_encoder)
            for position, index in enumerate(call.compute):
                call.states[index].tail_residuals = (
                    hidden_residual[position:position + 1].clone(),
                    None if encoder_residual is None else encoder_residual[position:position + 1].clone())
        return output
