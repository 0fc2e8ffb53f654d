"""What every per-row step cache does alike, whatever it computes: ``PerRowCache`` keeps one state per
row (an image's guidance branch), named by its caller through ``RowNames``: the step loop's sequence
branches (``rows``, and ``retain`` drops the states of rows no longer running at every step, so
memory is bounded by the batch), or positions within a pipeline's own ``__call__`` (``pipeline_call``,
every state dropped before and after it). Each row comes with its ``RowPlan``: its setting and its
denoiser calls left. It counts the rows run and skipped, gives each row the model's setting unless
its request set one, and installs its hooks on the denoiser's modules and removes them. A subclass
says when a row computes and what its hooks do (``RowCache``, ``UNetCache``, ``TaylorSeerCache``)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch
from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

from runner_service.acceleration.compiled_blocks import not_traced as not_traced  # the caches import it from here
from runner_service.acceleration.row_names import RowNames, RowPlan

_disabled: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable
_Function = TypeVar("_Function", bound=Callable[..., Any])


def eager(function: _Function) -> _Function:
    """``function`` run eagerly with all it calls, its type kept: what a hook calls to decide or to
    select rows, which traced would be small graphs of its own guarded on the rows and their states."""
    return cast(_Function, _disabled(function))


@dataclass
class RowState:
    """What every row's state holds: how many steps (denoiser calls) the row has been through."""

    steps: int = 0


StateT = TypeVar("StateT", bound=RowState)


@dataclass
class RowCall(Generic[StateT]):
    """One denoiser call under way: its rows' states, in order, and which rows compute."""

    states: list[StateT]
    compute: list[int]

    @property
    def rows(self) -> int:
        return len(self.states)


CallT = TypeVar("CallT", bound=RowCall[Any])


class ContextName(StateManager):
    """Receives the name a pipeline gives its denoiser call (``cache_context("cond")``): diffusers sets
    it on every StateManager of a stateful hook. No state is kept here."""

    def __init__(self) -> None:
        super().__init__(BaseState)  # type: ignore[arg-type]  # diffusers annotates an instance, takes the class

    @property
    def name(self) -> str | None:
        return None if self._context is None else self._context.name


class PerRowCache(abc.ABC, Generic[StateT, CallT]):
    """A step cache on a denoiser, per row; ``threshold`` and ``warmup_steps`` are the model's (a row's
    own setting comes with its call). ``new_state`` makes a row's state at its first call."""

    def __init__(self, threshold: float, warmup_steps: int, new_state: Callable[[], StateT]) -> None:
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.rows_run = 0
        self.rows_skipped = 0
        self.context = ContextName()  # for the hooks that receive the pipeline's cache_context
        self._new_state = new_state
        self._states: dict[Hashable, StateT] = {}
        self._names = RowNames(self.reset)
        self._call: CallT | None = None
        self._registries: list[tuple[HookRegistry, str]] = []

    def _hook(self, module: torch.nn.Module, hook: ModelHook, name: str) -> None:
        """Registers ``hook`` on ``module``, to be removed by ``remove``."""
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
        """A row's setting: the request's where it set one, else the model's."""
        return self.threshold if requested is None else requested

    @contextlib.contextmanager
    def rows(self, keys: Sequence[Hashable], thresholds: Sequence[float], remaining: Sequence[int]) -> Iterator[None]:
        """The next denoiser call's rows, in order, each with its setting and its calls left (this
        one included)."""
        with self._names.rows(keys, thresholds, remaining):
            try:
                yield
            finally:
                self._call = None

    @contextlib.contextmanager
    def pipeline_call(self, thresholds: Sequence[float], steps: int | None) -> Iterator[None]:
        """Around a pipeline's ``__call__`` of ``len(thresholds)`` images, each with its setting, whose
        rows are each called ``steps`` times (None: not known)."""
        with self._names.pipeline_call(thresholds, steps):
            try:
                yield
            finally:
                self._call = None

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these: the step loop's running rows, once per step (a
        step may call the denoiser once per size group), so memory is bounded by the batch."""
        self._states = {key: state for key, state in self._states.items() if key in keys}

    @abc.abstractmethod
    def begin(self, hidden: torch.Tensor) -> CallT | None:
        """Starts a denoiser call whose input is ``hidden`` (a row each): None when no call is planned
        (plain)."""

    def _planned(self, rows: int) -> tuple[list[RowPlan], list[StateT]] | None:
        """The plans and states of a denoiser call's ``rows`` rows, in order (a row's state made at
        its first call); None when no call is planned."""
        planned = self._names.planned(rows, self.context.name, self._taken)
        if planned is None:
            return None
        keys, plans = planned
        return plans, [self._states.setdefault(key, self._new_state()) for key in keys]

    def _taken(self, key: Hashable) -> int:
        """How many denoiser calls the row ``key`` has had (none without a state)."""
        state = self._states.get(key)
        return 0 if state is None else state.steps

    def _advance(self, states: list[StateT], computing: int) -> None:
        """Counts a call's rows, ``computing`` of which compute, and moves every row a step on."""
        for state in states:
            state.steps += 1
        self.rows_run += len(states)
        self.rows_skipped += len(states) - computing

    def end(self) -> None:
        self._call = None

    @property
    def call(self) -> CallT | None:
        return self._call


def original(hook: ModelHook) -> Any:
    """The module's own forward, under the hook (diffusers types ``fn_ref`` as None until registered)."""
    return hook.fn_ref.original_forward


class ContextHook(ModelHook):
    """A hook that receives the pipeline's ``cache_context`` name for its cache (stateful for that
    only: there is no state of diffusers' to reset)."""

    _is_stateful = True

    def __init__(self, context: ContextName) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.context = context  # diffusers' cache_context reaches it through this attribute

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class CallHook(ContextHook):
    """On the denoiser: starts each call (the cache decides from its ``argument``, the rows' input)
    and ends it when the call returns."""

    def __init__(self, cache: PerRowCache[Any, Any], argument: str) -> None:
        super().__init__(cache.context)
        self.cache = cache
        self.argument = argument

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.cache.begin(args[0] if args else kwargs[self.argument]) is None:
            return original(self)(*args, **kwargs)
        try:
            return original(self)(*args, **kwargs)
        finally:
            self.cache.end()
