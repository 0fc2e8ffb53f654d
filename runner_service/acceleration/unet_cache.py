"""DeepCache on a UNet, with its schedule and cached deep features kept per row.

DeepCache (Ma et al., 2023; the ``DeepCache`` package) reuses a UNet's deep features between
steps, which change slowly while the shallow ones carry the detail: at a full step the whole UNet
runs and the input of its last up block (what every block below the first level made) is kept; at a
cached step only the shallow part runs (the time embedding, ``conv_in``, the first down block, the
last up block, ``conv_out``) and the last up block takes the kept features in place of the deep
blocks' output. Its schedule is uniform: a full step every ``interval`` steps, the steps between
reuse (after ``warmup_steps`` full ones here). This is the package's ``DeepCacheSDHelper`` with
``cache_branch_id`` at the first level's last layer and ``skip_mode="uniform"`` (tested against it).

The package is not used: it decides for a whole pipeline call by the step's index in the
pipeline's shared scheduler (``scheduler.timesteps.index(t.item())``, one timestep per call) and
keeps one cached output per module, so it cannot serve a step batch, whose rows are at their own
steps of their own schedules. Here, on diffusers' hook registry, every row (an image's guidance
branch) has its own step count, interval and features: in one UNet call the shallow blocks run for
every row, the deep blocks only for the rows at a full step (their per-row arguments indexed, the
other rows' outputs zeros, never read), and the last up block gives each other row its own kept
features. A row joining late starts with none, so its first step is full.

A row's setting is the request's ``cache_threshold`` read as the interval: a whole number of steps;
0 or 1 never reuses. Rows are named by the caller, as in ``RowCache``: the step loop's sequence
branches (``rows``, states of rows no longer running dropped by ``retain``), or positions within a
pipeline's own ``__call__`` (``pipeline_call``), every state dropped before and after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from torch.utils import _pytree as pytree

_CALL_HOOK = "unet_cache_call"
_DEEP_HOOK = "unet_cache_deep"
_SHALLOW_HOOK = "unet_cache_shallow"

# The hooks decide and index eagerly; the blocks' own forwards (compiled where asked) run under them.
_not_traced: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    recursive=False)


@dataclass
class _RowState:
    """One row's cache: the last up block's input at its last full step, and how many steps it has
    been through."""

    features: torch.Tensor | None = None  # 1 x C x h x w
    shape: tuple[int, ...] = ()  # the UNet input's shape without its batch dimension
    steps: int = 0


@dataclass
class _Call:
    """One UNet call under way: its rows' names, which of them run the deep blocks, and its input's
    shape without the batch dimension (the deep blocks' outputs are made from it where none runs)."""

    keys: list[Hashable]
    intervals: list[int]
    compute: list[int]
    index: torch.Tensor  # ``compute`` as an index tensor
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def every_row(self) -> bool:
        return len(self.compute) == self.rows


# A deep block's output for a call of n rows, as the zeros it is made of where no row runs it: the
# output's structure and each leaf's shape without the batch dimension and dtype.
_Template = tuple[pytree.TreeSpec, list[tuple[tuple[int, ...], torch.dtype]]]


class UNetCache:
    """``deep_cache`` on a UNet, per row; ``threshold`` is the model's interval and ``warmup_steps``
    the full steps every row starts with (a row's own interval comes with its call)."""

    @staticmethod
    def supports(denoiser: torch.nn.Module) -> bool:
        """Whether the denoiser is diffusers' conditional UNet with a level below the first."""
        return (isinstance(denoiser, UNet2DConditionModel) and len(denoiser.down_blocks) >= 2
                and len(denoiser.up_blocks) == len(denoiser.down_blocks))

    def __init__(self, denoiser: torch.nn.Module, threshold: float, warmup_steps: int) -> None:
        if not self.supports(denoiser):
            raise ValueError(f"{type(denoiser).__name__} is not a UNet with deep blocks to reuse")
        assert isinstance(denoiser, UNet2DConditionModel)  # supports() checked it
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.rows_run = 0
        self.rows_skipped = 0
        self._states: dict[Hashable, _RowState] = {}
        self._templates: dict[tuple[tuple[int, ...], int], _Template] = {}
        self._intervals: list[float] | None = None  # the pipeline call's, per image
        self._keys: list[Hashable] | None = None  # the step loop's next call's rows
        self._row_intervals: list[float] = []
        self._call: _Call | None = None
        middle = [] if denoiser.mid_block is None else [denoiser.mid_block]
        deep: list[torch.nn.Module] = [*denoiser.down_blocks[1:], *middle, *denoiser.up_blocks[:-1]]
        hooks: list[tuple[torch.nn.Module, ModelHook, str]] = [
            (denoiser, _CallHook(self), _CALL_HOOK),
            *((block, _DeepHook(self, index), _DEEP_HOOK) for index, block in enumerate(deep)),
            (denoiser.up_blocks[-1], _ShallowHook(self), _SHALLOW_HOOK)]
        self._deep_blocks = len(deep)
        self._registries: list[tuple[HookRegistry, str]] = []
        for module, hook, name in hooks:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            registry.register_hook(hook, name)
            self._registries.append((registry, name))

    def remove(self) -> None:
        """Detaches the hooks: the UNet runs as before."""
        for registry, name in self._registries:
            registry.remove_hook(name, recurse=False)
        self._registries.clear()
        self.reset()

    def reset(self) -> None:
        """Forgets every row's state (the weights changed, or the model woke)."""
        self._states.clear()
        self._templates.clear()

    @property
    def live_rows(self) -> int:
        """How many rows hold a cached state now."""
        return len(self._states)

    def threshold_for(self, requested: float | None) -> float:
        """A row's interval: the request's where it set one, else the model's."""
        return self.threshold if requested is None else requested

    @contextlib.contextmanager
    def rows(self, keys: Sequence[Hashable], thresholds: Sequence[float]) -> Iterator[None]:
        """The next UNet call's rows, in order, each with its interval."""
        if len(keys) != len(thresholds) or len(set(keys)) != len(keys):
            raise ValueError("one distinct key and one interval per row")
        self._keys, self._row_intervals = list(keys), list(thresholds)
        try:
            yield
        finally:
            self._keys, self._call = None, None

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drops the state of every row but these, and the output shapes no kept row's input has: the
        step loop's running rows, once per step, so memory is bounded by the batch."""
        self._states = {key: state for key, state in self._states.items() if key in keys}
        shapes = {state.shape for state in self._states.values()}
        self._templates = {key: template for key, template in self._templates.items() if key[0] in shapes}

    @contextlib.contextmanager
    def pipeline_call(self, thresholds: Sequence[float]) -> Iterator[None]:
        """Around a pipeline's ``__call__`` of ``len(thresholds)`` images: a UNet call's row r is
        image ``r % len(thresholds)`` (guided pipelines stack the negative rows first)."""
        self.reset()
        self._intervals = list(thresholds)
        try:
            yield
        finally:
            self._intervals, self._call = None, None
            self.reset()

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # decided eagerly
    def begin(self, sample: torch.Tensor) -> _Call | None:
        """Starts a UNet call on ``sample`` and decides which rows run the deep blocks: those in their
        warmup, without kept features, with an interval below 2 or at a multiple of their interval
        after the warmup. None when no call is planned (plain)."""
        rows, shape = sample.shape[0], tuple(sample.shape[1:])
        if self._keys is not None:
            keys, intervals = self._keys, self._row_intervals
        elif self._intervals is not None:
            images = len(self._intervals)
            if rows % images:
                raise ValueError(f"a UNet call of {rows} rows for {images} images")
            keys = list(range(rows))
            intervals = [self._intervals[row % images] for row in range(rows)]
        else:
            return None
        if len(keys) != rows:
            raise ValueError(f"a UNet call of {rows} rows, planned for {len(keys)}")
        states = [self._states.setdefault(key, _RowState()) for key in keys]
        whole = [int(interval) for interval in intervals]
        compute = [index for index, (state, interval) in enumerate(zip(states, whole, strict=True))
                   if self._full(state, interval, shape)]
        if not compute and any((shape, block) not in self._templates for block in range(self._deep_blocks)):
            compute = list(range(rows))  # no deep output of this shape seen (not with kept features of it)
        for state in states:
            state.steps += 1
            state.shape = shape
        self.rows_run += rows
        self.rows_skipped += rows - len(compute)
        self._call = _Call(keys, whole, compute, torch.tensor(compute, dtype=torch.long, device=sample.device), shape)
        return self._call

    def _full(self, state: _RowState, interval: int, shape: tuple[int, ...]) -> bool:
        """Whether a row runs the deep blocks at this call."""
        if interval < 2 or state.features is None or state.shape != shape or state.steps < self.warmup_steps:
            return True
        return (state.steps - self.warmup_steps) % interval == 0

    def end(self) -> None:
        self._call = None

    @property
    def call(self) -> _Call | None:
        return self._call

    def state(self, call: _Call, index: int) -> _RowState:
        return self._states[call.keys[index]]

    def template(self, call: _Call, block: int) -> _Template | None:
        return self._templates.get((call.shape, block))

    def keep_template(self, call: _Call, block: int, output: Any) -> None:
        """Remembers the shapes of a deep block's output for calls of this input shape."""
        if (call.shape, block) not in self._templates:
            leaves, spec = pytree.tree_flatten(output)
            self._templates[call.shape, block] = (spec, [(tuple(leaf.shape[1:]), leaf.dtype) for leaf in leaves])


def _original(hook: ModelHook) -> Any:
    """The module's own forward, under the hook (diffusers types ``fn_ref`` as None until registered)."""
    return hook.fn_ref.original_forward


class _CallHook(ModelHook):
    """On the UNet: starts each call's decision and ends it when the call returns."""

    def __init__(self, cache: UNetCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        sample = args[0] if args else kwargs["sample"]
        if self.cache.begin(sample) is None:
            return _original(self)(*args, **kwargs)
        try:
            return _original(self)(*args, **kwargs)
        finally:
            self.cache.end()


class _DeepHook(ModelHook):
    """On each block below the first level: runs it on the rows at a full step only; the other rows'
    outputs are zeros of its output's shape (the last up block replaces what they lead to)."""

    def __init__(self, cache: UNetCache, block: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.block = block

    @_not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.cache.call
        if call is None:
            return _original(self)(*args, **kwargs)
        if call.every_row or (call.compute and _holds_call_rows(module)):
            output = _original(self)(*args, **kwargs)
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
        output = _original(self)(*args, **kwargs)
        self.cache.keep_template(call, self.block, output)
        return pytree.tree_map(lambda value: _scattered(value, call), output)


class _ShallowHook(ModelHook):
    """On the last up block: keeps the input (the deep blocks' output) of each row at a full step and
    gives each other row its own kept input."""

    def __init__(self, cache: UNetCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache

    @_not_traced
    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        call = self.cache.call
        if call is None:
            return args, kwargs
        hidden: torch.Tensor = args[0] if args else kwargs["hidden_states"]
        for index in call.compute:
            if call.intervals[index] >= 2:  # a row that never reuses keeps nothing
                self.cache.state(call, index).features = hidden[index:index + 1].clone()
        if call.every_row:
            return args, kwargs
        hidden = hidden.clone()
        for index in sorted(set(range(call.rows)) - set(call.compute)):
            features = self.cache.state(call, index).features
            assert features is not None  # begin() runs every row without kept features
            hidden[index] = features[0]
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


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
