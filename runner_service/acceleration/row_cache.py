"""First Block Cache with its decision and cached residuals kept per row.

diffusers' First Block Cache (``diffusers.hooks.first_block_cache``) runs the denoiser's first
transformer block at every step and compares its residual (output minus input) with the one of the
last step that ran in full: when the relative mean change is below the threshold, the remaining
blocks are skipped and their residual from that step is added instead. diffusers keeps one state per
call (``cache_context``: "cond", "uncond") and decides for the whole batch at once, so a batch's rows
share one decision and one residual. Under step-level batching a row is one request's image at its
own step, next to others at theirs: here every row (an image's guidance branch) has its own state,
its own decision and its own threshold (a request's ``cache_threshold``; 0 never skips).

A step computes the remaining blocks only for the rows that need them: each block runs on those
rows (the tensor arguments whose first dimension is the batch's rows are indexed; tuples such as
rotary embeddings are shared) while the skipping rows pass through it with their cached result. A
single image decides exactly as diffusers' hook does (tested against it).

Rows are named by the caller. The step loop names each sequence's branch (``rows``), and the
states of rows no longer running are dropped at every step (``retain``): memory is bounded by the
batch. Around a pipeline's own ``__call__``
(``pipeline_call``) a row is its position within the pipeline's ``cache_context``, and every state is
dropped before and after the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

from runner_service.acceleration.compiled_blocks import block_inputs, contiguous, padded, skip_hook_wrapper

_HEAD_HOOK = "row_cache_head"
_BLOCK_HOOK = "row_cache_block"


@dataclass
class _RowState:
    """One row's cache: the first block's residual and the remaining blocks' residuals (hidden and
    encoder states) of its last full step, and how many steps it has been through."""

    head_residual: torch.Tensor | None = None
    tail_residuals: tuple[torch.Tensor, torch.Tensor | None] | None = None
    steps: int = 0


@dataclass
class _Call:
    """One denoiser call under way: its rows' names and thresholds, which of them compute, and the
    first block's output for those (the tail's residuals are measured from it)."""

    keys: list[Hashable]
    thresholds: list[float]
    compute: list[int]
    compute_index: torch.Tensor | None = None  # ``compute`` as an index tensor, for the blocks to select by
    head_hidden: torch.Tensor | None = None
    head_encoder: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.keys)


class _ContextName(StateManager):
    """Receives the name a pipeline gives its denoiser call (``cache_context("cond")``): diffusers sets
    it on every StateManager of a stateful hook. No state is kept here."""

    def __init__(self) -> None:
        super().__init__(BaseState)  # type: ignore[arg-type]  # diffusers annotates an instance, takes the class

    @property
    def name(self) -> str | None:
        return None if self._context is None else self._context.name


def _blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoiser's transformer blocks in call order, as diffusers' First Block Cache finds them."""
    blocks: list[torch.nn.Module] = []
    for name, child in denoiser.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList):
            blocks.extend(child)
    return blocks


def _metadata(block: torch.nn.Module) -> TransformerBlockMetadata | None:
    try:
        metadata: TransformerBlockMetadata = TransformerBlockRegistry.get(type(block))
    except ValueError:
        return None
    return metadata


class RowCache:
    """``first_block_cache`` on a denoiser, per row; ``threshold`` and ``warmup_steps`` are the model's
    (a row's own threshold comes with its call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser has two or more transformer blocks that diffusers describes."""
        blocks = _blocks(denoiser)
        return len(blocks) >= 2 and all(_metadata(block) is not None for block in blocks)

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} has no transformer blocks diffusers describes")
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.rows_run = 0
        self.rows_skipped = 0
        self._states: dict[Hashable, _RowState] = {}
        self._thresholds: list[float] | None = None  # the pipeline call's, per image
        self._keys: list[Hashable] | None = None  # the step loop's next call's rows
        self._row_thresholds: list[float] = []
        self._call: _Call | None = None
        self._context = _ContextName()
        self._registries: list[tuple[HookRegistry, str]] = []
        blocks = _blocks(denoiser)
        for index, block in enumerate(blocks):
            metadata = _metadata(block)
            assert metadata is not None  # supports() checked every block
            registry = HookRegistry.check_if_exists_or_initialize(block)
            if index == 0:
                registry.register_hook(_HeadHook(self, metadata), _HEAD_HOOK)
                self._registries.append((registry, _HEAD_HOOK))
            else:
                hook = _BlockHook(self, metadata, tail=index == len(blocks) - 1)
                registry.register_hook(hook, _BLOCK_HOOK)
                self._registries.append((registry, _BLOCK_HOOK))
            skip_hook_wrapper(block)

    def remove(self) -> None:
        """Detaches the hooks: the denoiser runs as before."""
        for registry, name in self._registries:
            registry.remove_hook(name, recurse=False)
        self._registries.clear()
        self.reset()

    def reset(self) -> None:
        """Forgets every row's state (the weights changed, or the model woke)."""
        self._states.clear()

    @property
    def live_rows(self) -> int:
        """How many rows hold a cached state now."""
        return len(self._states)

    def threshold_for(self, requested: float | None) -> float:
        """A row's threshold: the request's where it set one, else the model's."""
        return self.threshold if requested is None else requested

    @contextlib.contextmanager
    def rows(self, keys: Sequence[Hashable], thresholds: Sequence[float]) -> Iterator[None]:
        """The next denoiser call's rows, in order, each with its threshold."""
        if len(keys) != len(thresholds) or len(set(keys)) != len(keys):
            raise ValueError("one distinct key and one threshold per row")
        self._keys, self._row_thresholds = list(keys), list(thresholds)
        try:
            yield
        finally:
            self._keys, self._call = None, None

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these: the step loop's running rows, once per step (a
        step may call the denoiser once per size group), so memory is bounded by the batch."""
        self._states = {key: state for key, state in self._states.items() if key in keys}

    @contextlib.contextmanager
    def pipeline_call(self, thresholds: Sequence[float]) -> Iterator[None]:
        """Around a pipeline's ``__call__`` of ``len(thresholds)`` images: a denoiser call's row r is
        image ``r % len(thresholds)`` (guided pipelines stack the negative rows first), named by its
        position within the pipeline's ``cache_context``."""
        self.reset()
        self._thresholds = list(thresholds)
        try:
            yield
        finally:
            self._thresholds, self._call = None, None
            self.reset()

    def begin(self, rows: int) -> _Call | None:
        """Starts a denoiser call of ``rows`` rows: None when no call is planned (plain)."""
        if self._keys is not None:
            keys, thresholds = self._keys, self._row_thresholds
        elif self._thresholds is not None:
            images = len(self._thresholds)
            if rows % images:
                raise ValueError(f"a denoiser call of {rows} rows for {images} images")
            keys = [(self._context.name, row) for row in range(rows)]
            thresholds = [self._thresholds[row % images] for row in range(rows)]
        else:
            return None
        if len(keys) != rows:
            raise ValueError(f"a denoiser call of {rows} rows, planned for {len(keys)}")
        self._call = _Call(keys, thresholds, list(range(rows)))
        return self._call

    @property
    def call(self) -> _Call | None:
        return self._call

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # decided eagerly: it reads the values
    def decide(self, call: _Call, residual: torch.Tensor) -> list[int]:
        """The rows of ``call`` that run the remaining blocks: those in their warmup, without a cached
        step, with threshold 0 or whose first-block residual changed by more than their threshold
        (diffusers' measure: mean |residual - previous| / mean |previous|, here per row)."""
        states = [self._states.setdefault(key, _RowState()) for key in call.keys]
        cached = [index for index, state in enumerate(states)
                  if state.tail_residuals is not None and state.head_residual is not None
                  and call.thresholds[index] > 0 and state.steps >= self.warmup_steps]
        skip: set[int] = set()
        if cached:
            current = residual[cached].flatten(1)
            previous = torch.cat([states[index].head_residual for index in cached]).flatten(1)  # type: ignore[misc]
            change = ((current - previous).abs().mean(1) / previous.abs().mean(1)).tolist()
            skip = {index for index, value in zip(cached, change, strict=True) if value <= call.thresholds[index]}
        for state in states:
            state.steps += 1
        self.rows_run += call.rows
        self.rows_skipped += len(skip)
        return [index for index in range(call.rows) if index not in skip]

    def state(self, call: _Call, index: int) -> _RowState:
        return self._states[call.keys[index]]


# The hooks run eagerly and the blocks' own forwards they call are compiled (``recursive=False``):
# traced, each hook (one per block, each with its own attributes) would be a graph of its own and
# exhaust dynamo's recompile limit on a model of many blocks, leaving the rest uncompiled.
_not_traced: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    recursive=False)


def _batch_rows(value: Any, rows: int, index: torch.Tensor) -> Any:
    """``value`` for the rows in ``index`` where it is one of the call's per-row tensors."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value.index_select(0, index)
    return value


class _HeadHook(ModelHook):
    """On the first block: decides per row, and gives the skipping rows their cached result."""

    _is_stateful = True

    def __init__(self, cache: RowCache, metadata: TransformerBlockMetadata) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.metadata = metadata
        self.context = cache._context  # diffusers' cache_context reaches it through this attribute

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        metadata = self.metadata
        hidden_in = metadata._get_parameter_from_args_kwargs(metadata.hidden_states_argument_name, args, kwargs)
        output = _original(self)(*args, **kwargs)
        call = self.cache.begin(hidden_in.shape[0])
        if call is None:
            return output
        hidden, encoder = _split(output, metadata)
        residual = hidden - hidden_in
        call.compute = self.cache.decide(call, residual)
        for index in call.compute:
            self.cache.state(call, index).head_residual = residual[index:index + 1].clone()
        rows = call.compute_index = torch.tensor(padded(call.compute, call.rows), dtype=torch.long,
                                                 device=hidden.device)
        call.head_hidden = hidden.index_select(0, rows)
        call.head_encoder = None if encoder is None else encoder.index_select(0, rows)
        if len(call.compute) == call.rows:
            return contiguous(output)
        skipped = sorted(set(range(call.rows)) - set(call.compute))
        hidden, encoder = hidden.clone(), None if encoder is None else encoder.clone()
        for index in skipped:
            tail_hidden, tail_encoder = self.cache.state(call, index).tail_residuals  # type: ignore[misc]
            hidden[index] += tail_hidden[0]
            if encoder is not None and tail_encoder is not None:
                encoder[index] += tail_encoder[0]
        return contiguous(_join(output, metadata, hidden, encoder))

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class _BlockHook(ModelHook):
    """On every later block: runs it on the computing rows only; the last one also keeps each
    computing row's residual over the remaining blocks."""

    def __init__(self, cache: RowCache, metadata: TransformerBlockMetadata, tail: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.metadata = metadata
        self.tail = tail

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None:
            return _original(self)(*args, **kwargs)
        metadata = self.metadata
        hidden_in = metadata._get_parameter_from_args_kwargs(metadata.hidden_states_argument_name, args, kwargs)
        encoder_in = None
        if metadata.return_encoder_hidden_states_index is not None:
            encoder_in = metadata._get_parameter_from_args_kwargs(
                metadata.encoder_hidden_states_argument_name, args, kwargs)
        if not call.compute:
            return _join(None, metadata, hidden_in, encoder_in)
        full = len(call.compute) == call.rows
        block_args, block_kwargs = block_inputs(args, kwargs, call.rows, None if full else call.compute_index)
        output = contiguous(_original(self)(*block_args, **block_kwargs))
        computed_hidden, computed_encoder = _split(output, metadata)
        if not full:
            assert call.compute_index is not None  # the head block set it
            rows, count = call.compute_index[:len(call.compute)], len(call.compute)  # the rest: padding
            hidden = hidden_in.index_copy(0, rows, computed_hidden[:count])
            encoder = (None if encoder_in is None or computed_encoder is None
                       else encoder_in.index_copy(0, rows, computed_encoder[:count]))
            output = _join(output, metadata, hidden, encoder)
        if self.tail:
            assert call.head_hidden is not None
            hidden_residual = computed_hidden - call.head_hidden
            encoder_residual = (None if computed_encoder is None or call.head_encoder is None
                                else computed_encoder - call.head_encoder)
            for position, index in enumerate(call.compute):
                self.cache.state(call, index).tail_residuals = (
                    hidden_residual[position:position + 1].clone(),
                    None if encoder_residual is None else encoder_residual[position:position + 1].clone())
        return output


def _original(hook: ModelHook) -> Any:
    """The block's own forward, under the hook (diffusers types ``fn_ref`` as None until registered)."""
    return hook.fn_ref.original_forward


def _split(output: Any, metadata: TransformerBlockMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's output as (hidden states, encoder hidden states or None)."""
    if not isinstance(output, tuple):
        return output, None
    encoder = (None if metadata.return_encoder_hidden_states_index is None
               else output[metadata.return_encoder_hidden_states_index])
    return output[metadata.return_hidden_states_index], encoder


def _join(output: Any, metadata: TransformerBlockMetadata, hidden: torch.Tensor,
          encoder: torch.Tensor | None) -> Any:
    """A block's output with these hidden (and encoder) states, in the block's own layout; ``output``
    None: the layout of a block that ran for no row."""
    encoder_index = metadata.return_encoder_hidden_states_index
    if not isinstance(output, tuple) and encoder_index is None:
        return hidden
    joined: list[Any] = list(output) if isinstance(output, tuple) else [None, None]
    joined[metadata.return_hidden_states_index] = hidden
    if encoder_index is not None:
        joined[encoder_index] = encoder
    return tuple(joined)
