"""What a step cache does so that the compiled blocks under its hooks never recompile while serving.

Under a step cache a step batch's rows that compute run the blocks after the first while the others
skip them, so those blocks see a sub-batch of changing size at almost every step. Regional compile
(``compile_repeated_blocks(dynamic=True)``) takes any batch of two or more rows in one graph, but
dynamo guards each graph on what it was traced with, and four things made a long mixed run
recompile while serving (and a model hit dynamo's recompile limit, 8 graphs a code object, past
which it runs eagerly):

- diffusers' hook wrapper: a hooked block's ``forward`` is one function of diffusers'
  (``HookRegistry``'s ``new_forward``) shared by every hooked block of every class. Dynamo traced it
  as the compiled region's first frame, up to the hook (which it does not trace), and guarded it on
  the block's class, its inputs' sizes and strides: one code object collecting graphs of every
  block class at every shape. ``skip_hook_wrapper`` leaves that frame untraced; the block's own
  ``forward``, which the hook calls, is still compiled (one code object per block class).
- a batch of one row: dynamo specializes a size of 1 (its 0/1 specialization), so a single
  computing row compiled a graph of its own. ``padded`` repeats a computing row to make two; the
  extra row's output is dropped. Padding further, to powers of two, would only add rows: the
  dynamic graph already takes every size of two or more, and a static graph per size would compile
  again at every image size.
- strides: a block's inputs were a view of the previous block's output (the single-stream blocks
  return slices) when every row computed, and a contiguous copy when some skipped; each layout
  is a graph of its own. ``block_inputs`` and ``contiguous`` hand every block contiguous tensors,
  and ``compile_repeated_blocks`` puts ``DenseInputs`` around every compiled block, with a cache
  or without: without one the same views, and a batch of one sliced from a larger tensor (dense
  by ``Tensor.is_contiguous`` whatever its first stride), compiled 4 of shapes' 12 graphs at load.
- the selection itself: code called from the cache's hooks was traced as small graphs of its own,
  guarded on each argument's rank and type. The functions here are not traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch._dynamo.decorators import skip

_eager: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable
# What a hook on a compiled block runs: the hook's own frame eagerly, the forwards it calls compiled
# where asked (``recursive=False``): traced, each hook (one per block, each with its own attributes)
# would be a graph of its own and exhaust dynamo's recompile limit on a model of many blocks,
# leaving the rest uncompiled.
not_traced: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    recursive=False)

DENSE_INPUTS_HOOK = "dense_inputs"

# The fewest rows a block runs on under the cache (see ``padded``).
SMALLEST = 2


def compile_repeated_blocks(denoiser: torch.nn.Module) -> None:
    """Compiles the denoiser's repeated blocks (diffusers' regional compile) with dynamic shapes, a
    new batch or image size reusing the kernels; each block is handed dense inputs
    (``DenseInputs``, outside any step cache's hooks on it)."""
    repeated = set(getattr(denoiser, "_repeated_blocks", None) or ())
    for block in denoiser.modules():
        if type(block).__name__ in repeated:
            HookRegistry.check_if_exists_or_initialize(block).register_hook(DenseInputs(), DENSE_INPUTS_HOOK)
            skip_hook_wrapper(block)
    denoiser.compile_repeated_blocks(dynamic=True)  # type: ignore[operator]


class DenseInputs(ModelHook):
    """Calls the block with every tensor argument dense (``dense``): dynamo guards a compiled block
    on its inputs' strides, and a block's input is often a view (Flux's single-stream blocks return
    slices of one tensor), which compiled a graph of its own for each layout."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @not_traced
    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _dense_arguments(args, kwargs)
        forward: Any = self.fn_ref.original_forward  # diffusers types it None until registered
        return forward(*args, **kwargs)


@_eager
def _dense_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(dense(value) for value in args), {name: dense(value) for name, value in kwargs.items()}


def dense(value: Any) -> Any:
    """A tensor with the strides of a fresh one of its shape (a copy only where they differ); any
    other value as it is. ``Tensor.contiguous`` is not enough: a view of one row (or of one
    token) is contiguous whatever the stride of its dimension of size 1, and dynamo guards that
    stride too (a batch of one sliced from a sequence of 13 tokens recompiled against one of 1)."""
    if not isinstance(value, torch.Tensor) or value.stride() == _fresh_strides(value.shape):
        return value
    return value.clone(memory_format=torch.contiguous_format)


def _fresh_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def skip_hook_wrapper(block: torch.nn.Module) -> None:
    """Leaves diffusers' hook wrapper (``block.forward`` once a hook is registered on it) untraced;
    the frames it calls, the block's own forward among them, are still compiled. The wrapper's code
    is one for every hooked module, so this holds for all of them."""
    wrapper = block.forward
    if isinstance(wrapper, functools.partial):
        skip(wrapper.func)


def padded(compute: list[int], rows: int) -> list[int]:
    """The rows to run, ``compute`` first: a single computing row of a call of several is run twice
    (the second output is dropped), so that a batch of one never reaches a compiled block apart
    from a call of one row."""
    if len(compute) >= SMALLEST or rows < SMALLEST or not compute:
        return compute
    return compute + compute[-1:] * (SMALLEST - len(compute))


@_eager
def block_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
                 index: torch.Tensor | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block call's arguments for the rows in ``index`` (None: all ``rows``): every tensor whose
    first dimension is the call's rows selected, and every tensor contiguous."""
    def rows_of(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if index is not None and value.dim() > 0 and value.shape[0] == rows:
            return value.index_select(0, index)
        return value.contiguous()

    return tuple(rows_of(value) for value in args), {name: rows_of(value) for name, value in kwargs.items()}


@_eager
def contiguous(output: Any) -> Any:
    """A block's output (a tensor or a tuple of them) with every tensor contiguous."""
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, tuple):
        return tuple(value.contiguous() if isinstance(value, torch.Tensor) else value for value in output)
    return output
