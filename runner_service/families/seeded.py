"""Seeded random weights, the same bytes on every build: what every tiny build makes its components with."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

SEED = 0
_Built = TypeVar("_Built")


def seeded(factory: Callable[[], _Built]) -> _Built:
    """Builds one component right after seeding torch, so its random weights never depend on the others."""
    torch.manual_seed(SEED)
    return factory()
