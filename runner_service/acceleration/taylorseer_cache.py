"""TaylorSeer on a transformer, with its schedule and Taylor factors kept per row.

TaylorSeer (Liu et al., 2025; diffusers' ``TaylorSeerCacheConfig``) computes the denoiser at some
steps and predicts it at the others by a Taylor series in the step: the features of the last computed
step and their divided differences over the computed steps before it. This is diffusers' lite mode
(``use_lite_mode=True``): every transformer block is skipped at a predicted step and the output
projection (``proj_out``, the denoiser's prediction before unpatchifying) is the predicted feature, so
a predicted step costs the embeddings and the final norm only. Its schedule: the first
``warmup_steps`` steps compute, then one step in ``interval`` (diffusers' ``disable_cache_before_step``
and ``cache_interval``); ``max_order`` 1, factors kept in the output's dtype. A single image computes
and predicts exactly as diffusers' hook does (tested against it).

diffusers keeps one state per call (``cache_context``) and counts steps per call, so a batch's rows
share one schedule and one set of factors. Under step-level batching a row is one request's image
at its own step: here every row (an image's guidance branch) has its own step count, interval and
factors. In one denoiser call the blocks run for the computing rows only (their per-row arguments
indexed, as ``RowCache`` does; the predicting rows pass through unchanged) and each predicting row's
output projection is replaced by its own prediction. A row joining late has no factors, so it
computes its warmup; it never reads another row's.

A row's setting is the request's ``cache_threshold`` read as the interval, a whole number of steps:
0 or 1 never predicts. Rows are named by the caller (``RowNames``): the step loop's sequence branches,
or positions within a pipeline's own ``__call__``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks._helpers import TransformerBlockMetadata
from diffusers.hooks.hooks import HookRegistry, ModelHook

from runner_service.acceleration.row_cache import (
    RowCache,
    _batch_rows,
    _blocks,
    _ContextName,
    _join,
    _metadata,
    _original,
    _split,
)
from runner_service.acceleration.row_names import RowNames

_CALL_HOOK = "taylorseer_call"
_BLOCK_HOOK = "taylorseer_block"
_OUTPUT_HOOK = "taylorseer_output"
MAX_ORDER = 1  # diffusers' default: the features and their first divided difference

_not_traced: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    recursive=False)


@dataclass
class _RowState:
    """One row's Taylor factors (order 0: its output at its last computed step; order j + 1: the
    divided difference of order j over its computed steps), that step, and its steps so far."""

    factors: list[torch.Tensor] = field(default_factory=list)
    last_computed: int | None = None
    steps: int = 0

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
class _Call:
    """One denoiser call under way: its rows' names and which of them compute."""

    keys: list[Hashable]
    intervals: list[int]
    compute: list[int]
    index: torch.Tensor  # ``compute`` as an index tensor

    @property
    def rows(self) -> int:
        return len(self.keys)


class TaylorSeerCache:
    """``taylorseer`` on a transformer, per row; ``threshold`` is the model's interval and
    ``warmup_steps`` the computed steps every row starts with (a row's own interval comes with its
    call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser has transformer blocks diffusers describes and an output projection."""
        return RowCache.supports(denoiser) and isinstance(getattr(denoiser, "proj_out", None), torch.nn.Module)

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} has no described transformer blocks and proj_out")
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.rows_run = 0
        self.rows_skipped = 0
        self._states: dict[Hashable, _RowState] = {}
        self._names = RowNames(self.reset)
        self._context = _ContextName()
        self._call: _Call | None = None
        hooks: list[tuple[torch.nn.Module, ModelHook, str]] = [(denoiser, _CallHook(self), _CALL_HOOK)]
        for block in _blocks(denoiser):
            metadata = _metadata(block)
            assert metadata is not None  # supports() checked every block
            hooks.append((block, _BlockHook(self, metadata), _BLOCK_HOOK))
        projection = denoiser.proj_out
        assert isinstance(projection, torch.nn.Module)  # supports() checked it
        hooks.append((projection, _OutputHook(self), _OUTPUT_HOOK))
        self._registries: list[tuple[HookRegistry, str]] = []
        for module, hook, name in hooks:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            registry.register_hook(hook, name)
            self._registries.append((registry, name))

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
        """How many rows hold a state now."""
        return len(self._states)

    def threshold_for(self, requested: float | None) -> float:
        """A row's interval: the request's where it set one, else the model's."""
        return self.threshold if requested is None else requested

    def rows(self, keys: Sequence[Hashable], thresholds: Sequence[float]) -> contextlib.AbstractContextManager[None]:
        """The next denoiser call's rows, in order, each with its interval."""
        return self._names.rows(keys, thresholds)

    def pipeline_call(self, thresholds: Sequence[float]) -> contextlib.AbstractContextManager[None]:
        """Around a pipeline's ``__call__`` of ``len(thresholds)`` images, each with its interval."""
        return self._names.pipeline_call(thresholds)

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these: the step loop's running rows, once per step."""
        self._states = {key: state for key, state in self._states.items() if key in keys}

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # decided eagerly
    def begin(self, hidden: torch.Tensor) -> _Call | None:
        """Starts a denoiser call on ``hidden`` and decides which rows compute: those without factors,
        in their warmup, with an interval below 2, or at their schedule's computed step (diffusers':
        ``(step - warmup - 1) % interval == 0``). None when no call is planned (plain)."""
        planned = self._names.planned(hidden.shape[0], self._context.name)
        if planned is None:
            return None
        keys, settings = planned
        states = [self._states.setdefault(key, _RowState()) for key in keys]
        intervals = [int(setting) for setting in settings]
        compute = [index for index, (state, interval) in enumerate(zip(states, intervals, strict=True))
                   if self._computes(state, interval)]
        for state in states:
            state.steps += 1
        self.rows_run += len(keys)
        self.rows_skipped += len(keys) - len(compute)
        self._call = _Call(keys, intervals, compute, torch.tensor(compute, dtype=torch.long, device=hidden.device))
        return self._call

    def _computes(self, state: _RowState, interval: int) -> bool:
        step = state.steps
        return (interval < 2 or state.last_computed is None or step < self.warmup_steps
                or (step - self.warmup_steps - 1) % interval == 0)

    def end(self) -> None:
        self._call = None

    @property
    def call(self) -> _Call | None:
        return self._call

    def state(self, call: _Call, index: int) -> _RowState:
        return self._states[call.keys[index]]


class _CallHook(ModelHook):
    """On the denoiser: starts each call's decision and ends it when the call returns. Stateful only
    to receive the pipeline's ``cache_context`` name."""

    _is_stateful = True

    def __init__(self, cache: TaylorSeerCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.context = cache._context

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.cache.begin(hidden) is None:
            return _original(self)(*args, **kwargs)
        try:
            return _original(self)(*args, **kwargs)
        finally:
            self.cache.end()

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class _BlockHook(ModelHook):
    """On every transformer block: runs it on the computing rows only; the predicting rows pass
    through unchanged (their output projection is replaced)."""

    def __init__(self, cache: TaylorSeerCache, metadata: TransformerBlockMetadata) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.metadata = metadata

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None or len(call.compute) == call.rows:
            return _original(self)(*args, **kwargs)
        metadata = self.metadata
        hidden_in = metadata._get_parameter_from_args_kwargs(metadata.hidden_states_argument_name, args, kwargs)
        encoder_in = None
        if metadata.return_encoder_hidden_states_index is not None:
            encoder_in = metadata._get_parameter_from_args_kwargs(
                metadata.encoder_hidden_states_argument_name, args, kwargs)
        if not call.compute:
            return _join(None, metadata, hidden_in, encoder_in)
        output = _original(self)(*(_batch_rows(value, call.rows, call.index) for value in args),
                                 **{name: _batch_rows(value, call.rows, call.index) for name, value in kwargs.items()})
        computed_hidden, computed_encoder = _split(output, metadata)
        hidden = hidden_in.index_copy(0, call.index, computed_hidden)
        encoder = None if encoder_in is None else encoder_in.index_copy(0, call.index, computed_encoder)
        return _join(output, metadata, hidden, encoder)


class _OutputHook(ModelHook):
    """On the output projection: updates each computing row's factors with its output and gives each
    predicting row its prediction."""

    def __init__(self, cache: TaylorSeerCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache

    @_not_traced
    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        call = self.cache.call
        if call is None:
            return output
        computing = set(call.compute)
        for index in call.compute:
            if call.intervals[index] >= 2:  # a row that never predicts keeps nothing
                self.cache.state(call, index).update(output[index:index + 1].clone())
        if len(computing) == call.rows:
            return output
        output = output.clone()
        for index in range(call.rows):
            if index not in computing:
                output[index] = self.cache.state(call, index).predict()[0]
        return output
