"""First Block Cache with its decision and cached residuals kept per row.

diffusers' First Block Cache (``diffusers.hooks.first_block_cache``) runs the denoiser's first
transformer block at every step and compares its residual (output minus input) with the one of the
last step that ran in full: when the relative mean change is below the threshold, the remaining
blocks are skipped and their residual from that step is added instead. diffusers keeps one state per
call (``cache_context``: "cond", "uncond") and decides for the whole batch at once, so a batch's rows
share one decision and one residual. Under step-level batching a row is one request's image at its
own step, next to others at theirs: here every row (an image's guidance branch) has its own state,
its own decision and its own threshold (its request's, else the model's; 0 never skips).

A step computes the remaining blocks only for the rows that need them: each block runs on those
rows (the tensor arguments whose first dimension is the batch's rows are indexed; tuples such as
rotary embeddings are shared) while the skipping rows pass through it with their cached result. A
single image decides exactly as diffusers' hook does (tested against it).

Rows are named and their states kept and dropped as in every per-row cache (``PerRowCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks._helpers import TransformerBlockMetadata
from diffusers.hooks.hooks import ModelHook

from runner_service.acceleration.compiled_blocks import block_inputs, contiguous, padded, skip_hook_wrapper
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
    inputs,
    join,
    scattered,
    split,
)

_HEAD_HOOK = "row_cache_head"
_BLOCK_HOOK = "row_cache_block"


@dataclass
class _RowState(RowState):
    """One row's cache: the first block's residual and the remaining blocks' residuals (hidden and
    encoder states) of its last full step."""

    head_residual: torch.Tensor | None = None
    tail_residuals: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class _Call(RowCall[_RowState]):
    """One denoiser call under way: its rows' thresholds, and the first block's output for the
    computing rows (the tail's residuals are measured from it)."""

    thresholds: list[float]
    compute_index: torch.Tensor | None = None  # ``compute`` as an index tensor, for the blocks to select by
    head_hidden: torch.Tensor | None = None
    head_encoder: torch.Tensor | None = None


class RowCache(PerRowCache[_RowState, _Call]):
    """``first_block_cache`` on a denoiser, per row; ``threshold`` and ``warmup_steps`` are the model's
    (a row's own threshold comes with its call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser has two or more transformer blocks that diffusers describes."""
        return has_described_blocks(denoiser)

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} has no transformer blocks diffusers describes")
        super().__init__(threshold, warmup_steps, _RowState)
        found = blocks(denoiser)
        for index, block in enumerate(found):
            metadata = block_metadata(block)
            assert metadata is not None  # supports() checked every block
            if index == 0:
                self._hook(block, _HeadHook(self, metadata), _HEAD_HOOK)
            else:
                self._hook(block, _BlockHook(self, metadata, tail=index == len(found) - 1), _BLOCK_HOOK)
            skip_hook_wrapper(block)

    @eager
    def begin(self, hidden: torch.Tensor) -> _Call | None:
        """Starts a denoiser call, every row computing until ``decide``."""
        rows = hidden.shape[0]
        planned = self._planned(rows)
        if planned is None:
            return None
        thresholds, states = planned
        self._call = _Call(states, list(range(rows)), thresholds)
        return self._call

    @eager
    def decide(self, call: _Call, residual: torch.Tensor) -> list[int]:
        """The rows of ``call`` that run the remaining blocks: those in their warmup, without a cached
        step, with threshold 0 or whose first-block residual changed by more than their threshold
        (diffusers' measure: mean |residual - previous| / mean |previous|, here per row)."""
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


class _HeadHook(ContextHook):
    """On the first block: starts the call, decides per row, and gives the skipping rows their cached
    result."""

    def __init__(self, cache: RowCache, metadata: TransformerBlockMetadata) -> None:
        super().__init__(cache.context)
        self.cache = cache
        self.metadata = metadata

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        metadata = self.metadata
        hidden_in = metadata._get_parameter_from_args_kwargs(metadata.hidden_states_argument_name, args, kwargs)
        output = original(self)(*args, **kwargs)
        call = self.cache.begin(hidden_in)
        if call is None:
            return output
        hidden, encoder = split(output, metadata)
        residual = hidden - hidden_in
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
    """On every later block: runs it on the computing rows only; the last one also keeps each
    computing row's residual over the remaining blocks."""

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
        metadata = self.metadata
        hidden_in, encoder_in = inputs(metadata, args, kwargs)
        if not call.compute:
            return join(None, metadata, hidden_in, encoder_in)
        full = len(call.compute) == call.rows
        block_args, block_kwargs = block_inputs(args, kwargs, call.rows, None if full else call.compute_index)
        output = contiguous(original(self)(*block_args, **block_kwargs))
        computed_hidden, computed_encoder = split(output, metadata)
        if not full:
            assert call.compute_index is not None  # the head block set it
            output = scattered(output, metadata, hidden_in, encoder_in, call.compute_index[:len(call.compute)])
        if self.tail:
            assert call.head_hidden is not None
            hidden_residual = computed_hidden - call.head_hidden
            encoder_residual = (None if computed_encoder is None or call.head_encoder is None
                                else computed_encoder - call.head_encoder)
            for position, index in enumerate(call.compute):
                call.states[index].tail_residuals = (
                    hidden_residual[position:position + 1].clone(),
                    None if encoder_residual is None else encoder_residual[position:position + 1].clone())
        return output
