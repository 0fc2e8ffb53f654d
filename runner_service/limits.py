"""The runner's flag defaults and bounds, apart from torch: ``diffusion-runner --help`` reads them
without importing torch or diffusers."""

from __future__ import annotations

from dataclasses import dataclass

from serving_common.input_rules import MAX_GUIDANCE

# LoRA adapters resident on the device at once (--max-adapters).
DEFAULT_MAX_ADAPTERS = 8
# Encoded prompts kept for step-level batching (--prompt-cache-bytes): 64 MiB holds about 500 SD
# prompts (77 x 768 float32, with the negative) or 60 SDXL ones.
DEFAULT_PROMPT_CACHE_BYTES = 64 * 1024 * 1024
# ControlNets on the device at once, in bytes (--max-controlnet-bytes): four SDXL ControlNets in
# float16 (1.25 GB each), or ten of Stable Diffusion 1.5 (0.7 GB).
DEFAULT_MAX_CONTROLNET_BYTES = 8 * 1024**3


@dataclass(frozen=True)
class BatchLimits:
    """The runner's own bounds on a batch, within which it holds each item to the request rules
    (``serving_common.input_rules``): the worker applies tighter ones, these hold whoever calls.
    The first five are flags (``--max-batch-images``, ``--max-size``, ``--max-steps``,
    ``--max-frames``, ``--decode-budget-bytes``)."""

    max_batch_images: int = 16
    max_size: int = 2048
    max_steps: int = 1000
    # Video tasks (``--max-frames``, ``--decode-budget-bytes``): the most frames of one video, and
    # the bytes its VAE decode may take at its peak (0: diffusers' default tiles, unbounded).
    max_frames: int = 257
    decode_budget_bytes: int = 0
    max_guidance: float = MAX_GUIDANCE
    # An adapter's per-request scale multiplies its update: 1e30 overflows it (the worker allows 10).
    max_adapter_scale: float = 100.0
    # Request ids name the requests in the runner's log.
    max_request_id_chars: int = 256
