"""LoadWeights: named tensors from safetensors files, checked in full before anything changes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from runner_service.loaded_model import LoadedModel, WeightUpdate
from serving_common.errors import failed_precondition, invalid_argument

# Digests in messages: enough hex to tell files apart at a glance.
SHORT_DIGEST = 12


@dataclass(frozen=True)
class WeightsLoaded:
    """What one LoadWeights did: the tensor names copied, the update now in effect (None when the
    files held no tensors, which changes nothing) and the model's weights version after it."""

    names: list[str]
    update: WeightUpdate | None
    weights_version: str


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


def load_weights(model: LoadedModel, path: Path, expected_digest: str = "") -> WeightsLoaded:
    """Copies the file's tensors into the model, all or nothing.

    Names are ``<component>.<parameter or buffer name>``. The digest (when ``expected_digest`` is
    set) and every name, shape and dtype are checked before the first copy, so a bad file
    changes nothing.
    """
    tensors, digest = read_tensors(path)
    if expected_digest and expected_digest != digest:
        raise failed_precondition(
            f"{path} has digest {digest[:SHORT_DIGEST]}, not the expected {expected_digest[:SHORT_DIGEST]}; "
            "nothing loaded"
        )
    if not tensors:
        return WeightsLoaded([], None, model.weights_version)
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
    update = WeightUpdate(digest, frozenset(name.partition(".")[0] for name in targets))
    model.weight_updates.append(update)
    return WeightsLoaded(sorted(targets), update, model.weights_version)
