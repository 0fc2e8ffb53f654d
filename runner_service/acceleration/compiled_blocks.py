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
  is a graph of its own. ``block_inputs`` and ``contiguous`` hand every block contiguous tensors.
- the selection itself: code called from the cache's hooks was traced as small graphs of its own,
  guarded on each argument's rank and type. The functions here are not traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.decorators import skip

_eager: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable

# The fewest rows a block runs on under the cache (see ``padded``).
SMALLEST = 2


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
