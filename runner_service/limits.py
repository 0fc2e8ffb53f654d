"""The runner's flag defaults and bounds, apart from torch: ``diffusion-runner --help`` reads them
without importing torch or diffusers."""

from __future__ import annotations

from dataclasses import dataclass

# LoRA adapters resident on the device at once (--max-adapters).
DEFAULT_MAX_ADAPTERS = 8
# Encoded prompts kept for step-level batching (--prompt-cache-bytes): 64 MiB holds about 500 SD
# prompts (77 x 768 float32, with the negative) or 60 SDXL ones.
DEFAULT_PROMPT_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class BatchLimits:
    """The runner's own bounds on a batch (``--max-batch-images``, ``--max-size``, ``--max-steps``):
    the worker applies tighter ones, these hold whoever calls."""

    max_batch_images: int = 16
    max_size: int = 2048
    max_steps: int = 1000
