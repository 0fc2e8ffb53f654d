"""LoadWeights: named tensors from safetensors files, checked in full before anything changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from runner_service.errors import failed_precondition, invalid_argument
from runner_service.model import LoadedModel


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor in a .safetensors file or a directory of them, and a digest of their bytes."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise invalid_argument({"path": f"{path} holds no .safetensors files"})
    elif path.is_file():
        files = [path]
    else:
        raise invalid_argument({"path": f"{path} does not exist on the runner"})
    tensors: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    for file in files:
        data = file.read_bytes()
        digest.update(data)
        try:
            loaded = load(data)
        except (SafetensorError, ValueError) as error:
            raise invalid_argument({"path": f"{file} is not a safetensors file: {error}"}) from error
        duplicates = sorted(set(loaded) & set(tensors))
        if duplicates:
            raise invalid_argument({"path": f"tensors appear in more than one file: {duplicates}"})
        tensors.update(loaded)
    return tensors, digest.hexdigest()


def load_weights(model: LoadedModel, path: Path) -> list[str]:
    """Copies the file's tensors into the model, all or nothing; returns the names loaded.

    Names are ``<component>.<parameter or buffer name>``. Every name, shape and dtype is checked
    before the first copy, so a bad file changes nothing.
    """
    tensors, digest = read_tensors(path)
    if not tensors:
        return []
    targets: dict[str, torch.Tensor] = {}
    unknown, mismatched = [], {}
    asleep = set()
    for name, value in tensors.items():
        component_name, _, key = name.partition(".")
        component = model.components.get(component_name)
        state = dict(component.module.named_parameters()) if component else {}
        if component:
            state.update(component.module.named_buffers())
        if key not in state:
            unknown.append(name)
            continue
        if component.asleep:
            asleep.add(component_name)
            continue
        target = state[key]
        if target.shape != value.shape or target.dtype != value.dtype:
            mismatched[name] = (f"file has {tuple(value.shape)} {value.dtype}, "
                                f"model has {tuple(target.shape)} {target.dtype}")
        targets[name] = target
    if unknown:
        raise invalid_argument(
            {f"tensors[{name}]": "unknown tensor name" for name in unknown},
            f"unknown tensor names: {', '.join(sorted(unknown))}",
        )
    if mismatched:
        raise invalid_argument({f"tensors[{name}]": why for name, why in mismatched.items()})
    if asleep:
        raise failed_precondition(f"components asleep: {', '.join(sorted(asleep))}; call WakeUp first")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name].to(target.device))
    model.weight_updates.append((digest, frozenset(name.partition(".")[0] for name in targets)))
    return sorted(targets)
