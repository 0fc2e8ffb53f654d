"""Limits and defaults of the worker, set from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusion.v1 import common_pb2


@dataclass(frozen=True)
class Limits:
    """Bounds and defaults applied to every GenerateRequest."""

    min_size: int = 8
    max_size: int = 2048
    max_steps: int = 500
    max_images: int = 4
    max_prompt_chars: int = 2000
    max_request_id_chars: int = 128
    default_size: int = 64
    default_steps: int = 20
    default_guidance: float = 7.5


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker is started with."""

    listen: str = "127.0.0.1:50051"
    runners: tuple[str, ...] = ("127.0.0.1:50052",)
    # Loaded with Init at start; empty means start without a model.
    model: str = "tiny"
    dtype: int = common_pb2.DTYPE_UNSPECIFIED
    auto_wake: bool = False
    max_queue: int = 64
    # Seconds given to queued and running requests to finish after SIGTERM.
    grace: float = 30.0
    limits: Limits = field(default_factory=Limits)
