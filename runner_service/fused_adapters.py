"""Adapters fused into the base weights once, at load (LoadModelRequest.fused_adapters), as
vllm-omni's distill backend does for Lightning, Hyper-SD and LCM LoRAs.

Each LoRA is loaded through diffusers' ``load_lora_weights`` (kohya and peft layouts alike),
fused at its scale with ``fuse_lora`` and its peft layers removed with ``unload_lora_weights``:
what stays is the plain modules with the update in their weights, so requests pay nothing for it
and per-request adapters (``adapters.py``) apply on top. A level-2 sleep reads the base weights
back from the model's files; waking fuses the LoRAs into the woken components again (``refuse``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from runner_service.model_roots import ModelRoots
from runner_service.pipeline_adapter import short_reason
from serving_common.errors import failed_precondition, invalid_argument

# diffusers' own name for a LoRA's file in a directory (save_lora_weights).
LORA_FILE = "pytorch_lora_weights.safetensors"
_HASH_CHUNK = 1 << 20

# A source -> the file or directory it names and the roots its reads are confined to.
Locate = Callable[[str, str], tuple[Path, ModelRoots]]


@dataclass(frozen=True)
class CheckedFusion:
    """One adapter to fuse: its source as given, its file, its scale and the digest of its bytes."""

    source: str
    path: Path
    scale: float
    digest: str


def check_fusions(requested: Sequence[tuple[str, float | None]], locate: Locate) -> tuple[CheckedFusion, ...]:
    """Each (source, scale) checked: a .safetensors file, or a directory holding diffusers'
    ``pytorch_lora_weights.safetensors`` or a single .safetensors file; a finite scale (None: 1.0)."""
    checked = []
    for position, (source, scale) in enumerate(requested):
        field = f"fused_adapters[{position}]"
        if scale is not None and not math.isfinite(scale):
            raise invalid_argument({f"{field}.scale": f"{scale} is not a finite number"})
        path, roots = locate(source, f"{field}.source")
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            named = [file for file in files if file.name == LORA_FILE]
            if not named and len(files) != 1:
                raise invalid_argument({f"{field}.source": f"{source} holds no {LORA_FILE} and "
                                                            f"{len(files)} .safetensors files; name the file"})
            path = (named or files)[0]
        file = roots.regular_file(path, f"{field}.source")
        checked.append(CheckedFusion(source, file.resolved, 1.0 if scale is None else scale, _digest(file.resolved)))
    return tuple(checked)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _name(position: int) -> str:
    return f"fused_{position}"


def fuse(pipeline: Any, fusions: Sequence[CheckedFusion], components: Sequence[str] | None = None) -> None:
    """Fuses each adapter into the pipeline's weights (into ``components`` only, where given: the
    ones a wake-up read back), leaving no peft layers behind. Must run with no other adapter
    loaded: ``unload_lora_weights`` takes them all off."""
    if not fusions:
        return
    if not hasattr(pipeline, "load_lora_weights"):
        raise failed_precondition(f"{type(pipeline).__name__} takes no LoRA adapters to fuse")
    try:
        for position, fusion in enumerate(fusions):
            name = _name(position)
            try:
                pipeline.load_lora_weights(load_file(str(fusion.path)), adapter_name=name)
                adapted = [component for component, names in pipeline.get_list_adapters().items() if name in names]
                if not adapted:
                    raise ValueError("none of its tensors matches a layer of this model")
                into = [component for component in adapted if components is None or component in components]
                if into:
                    pipeline.fuse_lora(components=into, lora_scale=fusion.scale, adapter_names=[name])
            except Exception as error:  # noqa: BLE001 - any failure: the load fails naming the adapter
                raise failed_precondition(f"fused_adapters[{position}] {fusion.source!r} cannot be fused into "
                                          f"{type(pipeline).__name__}: {short_reason(error)}") from None
    finally:
        pipeline.unload_lora_weights()
