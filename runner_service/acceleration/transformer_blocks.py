"""A transformer's blocks as the per-row caches on it see them: found and described as diffusers'
caches find them (``TransformerBlockRegistry``), their hidden (and encoder) states read from a call
and written into its output, and a block's output for some rows put in place of those rows.

The caches' hooks run untraced but what they call is traced (``row_state.not_traced``): the
functions here that select or copy tensors run eagerly, or each would be small graphs of its own,
guarded on the rows' count (see ``compiled_blocks``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

from runner_service.acceleration.compiled_blocks import block_inputs, contiguous, not_traced
from runner_service.acceleration.row_state import eager


def blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoiser's transformer blocks in call order, as diffusers' First Block Cache finds them."""
    found: list[torch.nn.Module] = []
    for name, child in denoiser.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList):
            found.extend(child)
    return found


def block_metadata(block: torch.nn.Module) -> TransformerBlockMetadata | None:
    """How diffusers describes the block's arguments and outputs; None for a block it does not."""
    try:
        metadata: TransformerBlockMetadata = TransformerBlockRegistry.get(type(block))
    except ValueError:
        return None
    return metadata


def has_described_blocks(denoiser: torch.nn.Module) -> bool:
    """Whether the denoiser has two or more transformer blocks that diffusers describes."""
    found = blocks(denoiser)
    return len(found) >= 2 and all(block_metadata(block) is not None for block in found)


@eager
def inputs(metadata: TransformerBlockMetadata, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block call's hidden states and, where the block returns them, its encoder hidden states."""
    hidden = metadata._get_parameter_from_args_kwargs(metadata.hidden_states_argument_name, args, kwargs)
    encoder = None
    if metadata.return_encoder_hidden_states_index is not None:
        encoder = metadata._get_parameter_from_args_kwargs(
            metadata.encoder_hidden_states_argument_name, args, kwargs)
    return hidden, encoder


def split(output: Any, metadata: TransformerBlockMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's output as (hidden states, encoder hidden states or None)."""
    if not isinstance(output, tuple):
        return output, None
    encoder = (None if metadata.return_encoder_hidden_states_index is None
               else output[metadata.return_encoder_hidden_states_index])
    return output[metadata.return_hidden_states_index], encoder


def join(output: Any, metadata: TransformerBlockMetadata, hidden: torch.Tensor,
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


@eager
def scattered(output: Any, metadata: TransformerBlockMetadata, hidden_in: torch.Tensor,
              encoder_in: torch.Tensor | None, rows: torch.Tensor) -> Any:
    """A block's output for the rows in ``rows`` (its first ``len(rows)`` rows; any after them are
    padding) in place of those rows of its inputs: the other rows pass through unchanged."""
    computed_hidden, computed_encoder = split(output, metadata)
    count = rows.shape[0]
    hidden = hidden_in.index_copy(0, rows, computed_hidden[:count])
    encoder = (None if encoder_in is None or computed_encoder is None
               else encoder_in.index_copy(0, rows, computed_encoder[:count]))
    return join(output, metadata, hidden, encoder)


@not_traced  # its own frame eager, as its callers' are: ``forward`` runs compiled where the block is
def on_rows(forward: Callable[..., Any], metadata: TransformerBlockMetadata, args: tuple[Any, ...],
            kwargs: dict[str, Any], rows: int, compute: Sequence[int], index: torch.Tensor | None) -> tuple[Any, Any]:
    """A block run by ``forward`` for its call's ``compute`` rows only, of ``rows`` (``index``: them as
    an index tensor, padded, ``compiled_blocks.padded``; unused when every row computes), with
    contiguous inputs and outputs either way: one layout, so the compiled blocks' graphs serve every
    mix of rows and every per-row cache. Returns its output for the whole call (the other rows pass
    through unchanged) and its output for the computing rows (None when none compute)."""
    hidden_in, encoder_in = inputs(metadata, args, kwargs)
    if not compute:
        return join(None, metadata, hidden_in, encoder_in), None
    full = len(compute) == rows
    block_args, block_kwargs = block_inputs(args, kwargs, rows, None if full else index)
    computed = contiguous(forward(*block_args, **block_kwargs))
    if full:
        return computed, computed
    assert index is not None  # the caller's index of the computing rows
    return scattered(computed, metadata, hidden_in, encoder_in, index[:len(compute)]), computed
