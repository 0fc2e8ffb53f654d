"""DeepCache on a UNet, with its schedule and cached deep features kept per row.

DeepCache (Ma et al., 2023; the ``DeepCache`` package) reuses a UNet's deep features between
steps, which change slowly while the shallow ones carry the detail: at a full step the whole UNet
runs and the features entering the branch (a layer of the last up block) are kept; at a cached step
only the shallow part runs (the time embedding, ``conv_in``, the first down block's first ``branch``
layers, the last up block from the branch on, ``conv_out``) and the branch takes the kept features
in place of what the layers below it made. ``branch`` is the package's ``cache_branch_id`` within
the first level: at its number of layers (``layers_per_block``) the cached step runs the whole first
down block and last up block; at 0 it runs neither down layer and only the last up layer (beside
``conv_in``'s skip connection), for a cheaper cached step that reuses more. Its schedule is uniform:
a full step every ``interval`` steps, the steps between reuse (after ``warmup_steps`` full ones
here). This is the package's ``DeepCacheSDHelper`` with that ``cache_branch_id`` and
``skip_mode="uniform"`` (tested against it).

The package is not used: it decides for a whole pipeline call by the step's index in the
pipeline's shared scheduler (``scheduler.timesteps.index(t.item())``, one timestep per call) and
keeps one cached output per module, so it cannot serve a step batch, whose rows are at their own
steps of their own schedules. Here, on diffusers' hook registry, every row (an image's guidance
branch) has its own step count, interval and features: in one UNet call the shallow layers run for
every row, the deep ones only for the rows at a full step (their per-row arguments indexed, the
other rows' outputs zeros, never read), and the last of them gives each other row its own kept
features. A row joining late starts with none, so its first step is full.

A row's setting is its request's threshold (else the model's) read as the interval: a whole number
of steps; 0 or 1 never reuses. Rows are named and their states kept and dropped as in every per-row
cache (``PerRowCache``).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks.hooks import ModelHook
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from torch.utils import _pytree as pytree

from runner_service.acceleration.row_state import CallHook, PerRowCache, RowCall, RowState, eager, not_traced, original

_CALL_HOOK = "unet_cache_call"
_DEEP_HOOK = "unet_cache_deep"
# The first level's layers a cached step runs by default: none, measured on ``small`` at 128x128
# (docs/acceleration.md, "DeepCache on the UNet families").
DEFAULT_BRANCH = 0


@dataclass
class _RowState(RowState):
    """One row's cache: the features entering the branch at its last full step."""

    features: torch.Tensor | None = None  # C x h x w
    shape: tuple[int, ...] = ()  # the UNet input's shape without its batch dimension


@dataclass
class _Call(RowCall[_RowState]):
    """One UNet call under way: its rows' intervals, the rows running the deep blocks as an index,
    and its input's shape without the batch dimension (the deep blocks' outputs are made from it
    where none runs)."""

    intervals: list[int]
    index: torch.Tensor  # ``compute`` as an index tensor
    shape: tuple[int, ...]

    @property
    def every_row(self) -> bool:
        return len(self.compute) == self.rows


# A deep block's output for a call of n rows, as the zeros it is made of where no row runs it: the
# output's structure and each leaf's shape without the batch dimension and dtype.
_Template = tuple[pytree.TreeSpec, list[tuple[tuple[int, ...], torch.dtype]]]


class UNetCache(PerRowCache[_RowState, _Call]):
    """``deep_cache`` on a UNet, per row; ``threshold`` is the model's interval, ``warmup_steps`` the
    full steps every row starts with (a row's own interval comes with its call) and ``branch`` how many
    of the first level's layers a cached step runs (0 to ``layers_per_block``)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser is diffusers' conditional UNet with a level below the first."""
        return (isinstance(denoiser, UNet2DConditionModel) and len(denoiser.down_blocks) >= 2
                and len(denoiser.up_blocks) == len(denoiser.down_blocks))

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int,
                 branch: int = DEFAULT_BRANCH) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} is not a UNet with deep blocks to reuse")
        assert isinstance(denoiser, UNet2DConditionModel)  # supports() checked it
        layers = len(_layers(denoiser.down_blocks[0]))
        if not 0 <= branch <= layers:
            raise ValueError(f"branch {branch} is not one of the first level's 0 to {layers} layers")
        super().__init__(threshold, warmup_steps, _RowState)
        self._templates: dict[tuple[tuple[int, ...], int], _Template] = {}
        deep = _deep_modules(denoiser, branch)
        self._deep_blocks = len(deep)
        self._hook(denoiser, CallHook(self, "sample"), _CALL_HOOK)
        for index, module in enumerate(deep[:-1]):
            self._hook(module, _DeepHook(self, index), _DEEP_HOOK)
        self._hook(deep[-1], _BranchHook(self, len(deep) - 1), _DEEP_HOOK)

    def reset(self) -> None:
        """Forgets every row's state and output shape (the weights changed, or the model woke)."""
        super().reset()
        self._templates.clear()

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these, and the output shapes no kept row's input has."""
        super().retain(keys)
        shapes = {state.shape for state in self._states.values()}
        self._templates = {key: template for key, template in self._templates.items() if key[0] in shapes}

    @eager
    def begin(self, hidden: torch.Tensor) -> _Call | None:
        """Starts a UNet call on its ``sample`` and decides which rows run the deep blocks: those in
        their warmup, without kept features, with an interval below 2 or at a multiple of their
        interval after the warmup. None when no call is planned (plain)."""
        rows, shape = hidden.shape[0], tuple(hidden.shape[1:])
        planned = self._planned(rows)
        if planned is None:
            return None
        plans, states = planned
        intervals = [int(plan.setting) for plan in plans]
        compute = [index for index, (state, interval) in enumerate(zip(states, intervals, strict=True))
                   if self._full(state, interval, shape)]
        if not compute and any((shape, block) not in self._templates for block in range(self._deep_blocks)):
            compute = list(range(rows))  # no deep output of this shape seen (not with kept features of it)
        for state in states:
            state.shape = shape
        self._advance(states, len(compute))
        self._call = _Call(states, compute, intervals, torch.tensor(compute, dtype=torch.long, device=hidden.device),
                           shape)
        return self._call

    def _full(self, state: _RowState, interval: int, shape: tuple[int, ...]) -> bool:
        """Whether a row runs the deep blocks at this call."""
        if interval < 2 or state.features is None or state.shape != shape or state.steps < self.warmup_steps:
            return True
        return (state.steps - self.warmup_steps) % interval == 0

    def template(self, call: _Call, block: int) -> _Template | None:
        return self._templates.get((call.shape, block))

    def keep_template(self, call: _Call, block: int, output: Any) -> None:
        """Remembers the shapes of a deep block's output for calls of this input shape."""
        if (call.shape, block) not in self._templates:
            leaves, spec = pytree.tree_flatten(output)
            self._templates[call.shape, block] = (spec, [(tuple(leaf.shape[1:]), leaf.dtype) for leaf in leaves])


class _DeepHook(ModelHook):
    """On each module a cached step skips: runs it on the rows at a full step only; the other rows'
    outputs are zeros of its output's shape (the branch replaces what they lead to)."""

    def __init__(self, cache: UNetCache, block: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.block = block

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None:
            return original(self)(*args, **kwargs)
        if call.every_row or (call.compute and _holds_call_rows(module)):
            output = original(self)(*args, **kwargs)
            self.cache.keep_template(call, self.block, output)
            return output
        if not call.compute:
            template = self.cache.template(call, self.block)
            assert template is not None  # begin() runs every row where one is missing
            spec, leaves = template
            return pytree.tree_unflatten(
                [torch.zeros((call.rows, *shape), dtype=dtype, device=call.index.device) for shape, dtype in leaves],
                spec)
        args, kwargs = pytree.tree_map(lambda value: _rows_of(value, call), (args, kwargs))
        output = original(self)(*args, **kwargs)
        self.cache.keep_template(call, self.block, output)
        return pytree.tree_map(lambda value: _scattered(value, call), output)


class _BranchHook(_DeepHook):
    """On the last deep module, whose output (a tensor, alone or in a tuple) enters the branch: keeps
    it for each row at a full step and gives each other row its own kept features."""

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = super().new_forward(module, *args, **kwargs)
        call = self.cache.call
        if call is None:
            return output
        (hidden,) = pytree.tree_leaves(output)
        for index in call.compute:
            if call.intervals[index] >= 2:  # a row that never reuses keeps nothing
                call.states[index].features = hidden[index].clone()
        if call.every_row:
            return output
        # ``hidden`` is this call's own (zeros, the rows run scattered, or every row run): written in place
        for index in sorted(set(range(call.rows)) - set(call.compute)):
            features = call.states[index].features
            assert features is not None  # begin() runs every row without kept features
            hidden[index] = features
        return output


def _layers(block: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """A down or up block's layers in the order they run: each a resnet and its attention, if any."""
    resnets: list[torch.nn.Module] = list(getattr(block, "resnets", None) or [])
    attentions: list[torch.nn.Module] = list(getattr(block, "attentions", None) or [])
    return [[resnet, *attentions[index:index + 1]] for index, resnet in enumerate(resnets)]


def _deep_modules(unet: UNet2DConditionModel, branch: int) -> list[torch.nn.Module]:
    """The modules a cached step skips, in the order they run, the one entering the branch last: the
    first down block's layers from ``branch`` on and its downsamplers, every block below the first
    level, and the last up block's layers before the branch (one more layer than a down block has)."""
    first_down, last_up = unet.down_blocks[0], unet.up_blocks[-1]
    middle = [] if unet.mid_block is None else [unet.mid_block]
    up_skipped = len(_layers(last_up)) - 1 - branch
    return [*(module for layer in _layers(first_down)[branch:] for module in layer),
            *(getattr(first_down, "downsamplers", None) or []),
            *unet.down_blocks[1:], *middle, *unet.up_blocks[:-1],
            *(module for layer in _layers(last_up)[:up_skipped] for module in layer)]


def _holds_call_rows(block: torch.nn.Module) -> bool:
    """Whether an attention processor of the block holds state per row of the whole call, which a
    run on some rows would misread: the IP-Adapter's per-row scales (``runner_service.ip_adapters.
    RowScales``, in place of the floats diffusers' processors hold). Such a block runs every row."""
    for attention in block.modules():
        scales = getattr(getattr(attention, "processor", None), "scale", None)
        if isinstance(scales, list) and any(not isinstance(scale, int | float) for scale in scales):
            return True
    return False


def _rows_of(value: Any, call: _Call) -> Any:
    """``value`` for the rows at a full step where it is one of the call's per-row tensors."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == call.rows:
        return value.index_select(0, call.index)
    return value


def _scattered(value: Any, call: _Call) -> Any:
    """A deep block's output for the rows at a full step, as the call's rows (zeros for the others)."""
    if not isinstance(value, torch.Tensor):
        return value
    full = value.new_zeros((call.rows, *value.shape[1:]))
    return full.index_copy_(0, call.index, value)
