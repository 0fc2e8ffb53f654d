"""Tensors made of other tensors, as plain tensors and back.

torchao's quantized weights are tensor subclasses (an ``Int8Tensor`` holds int8 data and scales,
and reports the dtype it stands for). The offload store writes plain tensors only, so a sleeping
component's subclass tensors are stored as their parts (``__tensor_flatten__``) and rebuilt from
them on wake (``__tensor_unflatten__``), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Joins a tensor's name and its part's name in the store (parameter names use dots).
SEPARATOR = "#"


@dataclass(frozen=True)
class Layout:
    """What rebuilds one subclass tensor from its parts."""

    kind: type
    context: Any
    size: torch.Size
    stride: tuple[int, ...]
    parts: tuple[str, ...]


def is_composite(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "__tensor_flatten__")


def split(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Layout]]:
    """Plain tensors (composite ones replaced by their parts, named ``<name>#<part>``) and the
    layouts that ``join`` rebuilds them with."""
    plain: dict[str, torch.Tensor] = {}
    layouts: dict[str, Layout] = {}
    for name, tensor in tensors.items():
        if not is_composite(tensor):
            plain[name] = tensor
            continue
        parts, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        inner_plain, inner_layouts = split({f"{name}{SEPARATOR}{part}": getattr(tensor, part) for part in parts})
        plain.update(inner_plain)
        layouts.update(inner_layouts)
        layouts[name] = Layout(type(tensor), context, tensor.size(), tensor.stride(), tuple(parts))
    return plain, layouts


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: a composite one (which reports the dtype it stands for) counts its parts."""
    plain, _ = split({"": tensor})
    return sum(part.numel() * part.element_size() for part in plain.values())


def join(plain: dict[str, torch.Tensor], layouts: dict[str, Layout]) -> dict[str, torch.Tensor]:
    """The tensors ``split`` took apart, rebuilt (innermost first)."""
    tensors = dict(plain)
    for name in sorted(layouts, key=lambda name: -name.count(SEPARATOR)):
        layout = layouts[name]
        inner = {part: tensors.pop(f"{name}{SEPARATOR}{part}") for part in layout.parts}
        tensors[name] = layout.kind.__tensor_unflatten__(inner, layout.context, layout.size, layout.stride)  # type: ignore[attr-defined]
    return tensors
