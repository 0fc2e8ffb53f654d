"""The rules of a request's ControlNets and IP-Adapter (GenerateRequest.controls and .ip_adapter),
whatever the worker's flags: how many, the bounds of their scales and of the part of the denoising
a ControlNet steers, and the names of the adapter kinds as callers write them.

Both sides read them: the worker refuses a request that breaks one (INVALID_ARGUMENT naming the
field), and the runner can check an ExecuteItem against the same bounds. A name registered as
another kind is INVALID_ARGUMENT on both sides too; a name not registered at all is
FAILED_PRECONDITION (it may be registered later).
"""

from __future__ import annotations

import math

from diffusion.v1 import common_pb2

MAX_CONTROLS = 3  # ControlNets of one request
MAX_PROMPT_IMAGES = 4  # reference images of one IP-Adapter image prompt
MAX_CONDITIONING_SCALE = 2.0  # a ControlNet's conditioning_scale and an IP-Adapter's scale: 0 to this
# The tasks a ControlNet or an IP-Adapter steers (the issue's: text-to-image and image-to-image).
CONDITIONED_TASKS = (common_pb2.TASK_TEXT_TO_IMAGE, common_pb2.TASK_IMAGE_TO_IMAGE)

# The kinds as the clients, the CLI and the docs name them; unset is a LoRA.
KIND_NAMES: dict[int, str] = {
    common_pb2.ADAPTER_KIND_UNSPECIFIED: "lora",
    common_pb2.ADAPTER_KIND_LORA: "lora",
    common_pb2.ADAPTER_KIND_CONTROLNET: "controlnet",
    common_pb2.ADAPTER_KIND_IP_ADAPTER: "ip_adapter",
}
KINDS: dict[str, int] = {"lora": common_pb2.ADAPTER_KIND_LORA, "controlnet": common_pb2.ADAPTER_KIND_CONTROLNET,
                         "ip_adapter": common_pb2.ADAPTER_KIND_IP_ADAPTER}
# How a refusal names a kind.
KIND_TITLES: dict[int, str] = {
    common_pb2.ADAPTER_KIND_UNSPECIFIED: "LoRA",
    common_pb2.ADAPTER_KIND_LORA: "LoRA",
    common_pb2.ADAPTER_KIND_CONTROLNET: "ControlNet",
    common_pb2.ADAPTER_KIND_IP_ADAPTER: "IP-Adapter",
}
# The request field that names an adapter of each kind.
KIND_FIELDS: dict[int, str] = {
    common_pb2.ADAPTER_KIND_UNSPECIFIED: "adapters",
    common_pb2.ADAPTER_KIND_LORA: "adapters",
    common_pb2.ADAPTER_KIND_CONTROLNET: "controls",
    common_pb2.ADAPTER_KIND_IP_ADAPTER: "ip_adapter",
}


def kind_words(kind: int) -> str:
    """A kind as a refusal says what an adapter is: "a LoRA", "a ControlNet", "an IP-Adapter"."""
    title = KIND_TITLES.get(kind, "adapter")
    return f"{'an' if title[0] in 'AEIOU' else 'a'} {title}"


def same_kind(a: int, b: int) -> bool:
    """Whether two AdapterKind values name one kind (unset is a LoRA)."""
    return (a or common_pb2.ADAPTER_KIND_LORA) == (b or common_pb2.ADAPTER_KIND_LORA)


def wrong_kind(name: str, registered: int, wanted: int) -> str:
    """Why a request that names ``name`` where an adapter of kind ``wanted`` goes is refused: it is
    registered as another kind. Both sides refuse it INVALID_ARGUMENT naming the field: the request
    names something that is not of that kind (not one that may be registered later)."""
    return f"{name[:64]!r} is registered as {kind_words(registered)}, not as {kind_words(wanted)}"


def not_a_lora(name: str, registered: int) -> str:
    """Why a request that names ``name`` in its LoRA field (``adapters``) is refused: it is
    registered as another kind, which is named in that kind's own field. INVALID_ARGUMENT naming
    ``adapters[i].name`` on both sides."""
    return f"{name[:64]!r} is {kind_words(registered)}, not a LoRA: name it in {KIND_FIELDS[registered]}"


def scale_problem(scale: float) -> str | None:
    """A ControlNet's conditioning_scale or an IP-Adapter's scale: finite, 0 to MAX_CONDITIONING_SCALE."""
    if math.isfinite(scale) and 0.0 <= scale <= MAX_CONDITIONING_SCALE:
        return None
    return f"must be from 0 to {MAX_CONDITIONING_SCALE:g}, got {scale:g}"


def guidance_window_problems(start: float, end: float) -> list[tuple[str, str]]:
    """A ControlNet's guidance_start and guidance_end, as (field, problem): fractions of the steps,
    0 <= start < end <= 1."""
    problems = [(name, f"must be a finite fraction of the steps from 0 to 1, got {value:g}")
                for name, value in (("guidance_start", start), ("guidance_end", end))
                if not (math.isfinite(value) and 0.0 <= value <= 1.0)]
    if not problems and start >= end:
        problems.append(("guidance_start", f"must be below guidance_end ({end:g}), got {start:g}"))
    return problems


def count_problem(count: int, largest: int, what: str) -> str | None:
    """How many ControlNets (or reference images) a request gives: at most ``largest``."""
    return None if count <= largest else f"at most {largest} {what}, got {count}"
