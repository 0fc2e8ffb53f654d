"""LoRA adapters of the loaded model: registered by name, resident up to ``--max-adapters``,
activated per batch, never fused.

Adapters load through diffusers' ``load_lora_weights(state_dict, adapter_name=...)`` on the peft
backend, which converts kohya and peft key layouts to diffusers' own. peft wraps each adapted
layer: its base weight is then named ``<layer>.base_layer.weight`` and the adapter adds
``<layer>.lora_A.<name>.weight`` and ``lora_B``; ``canonical_state`` sees through that, so
LoadWeights, PushWeights and checksums keep the checkpoint's names. A batch without adapters runs
with LoRA disabled (the base layers alone: the base model's bytes exactly); with adapters,
``set_adapters`` activates exactly the batch's set at its scales.

An adapter whose tensors hold NaN or infinities, or whose update to a layer (B @ A, scaled)
overflows the layer's dtype, is refused at load: it would load and then turn every image black.

Every method runs on the runner's device thread, under its device lock.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from peft.tuners.lora import LoraLayer

from diffusion.v1 import common_pb2
from runner_service.adapter_stores import AdapterSource, SourceFiles
from runner_service.pipeline_adapter import short_reason
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, not_found
from serving_common.input_rules import adapter_name_problem

logger = logging.getLogger(__name__)

# peft's wrapper around an adapted layer, and the tensors an adapter adds (a LoRA's; an IP-Adapter's
# attention processors' and image projections', ``ip_adapters.py``).
_BASE_LAYER = ".base_layer."
_ADAPTER_TENSOR = re.compile(r"(^|\.)(lora_[A-Za-z_]+|to_[kv]_ip|image_projection_layers)(\.|$)")

AdapterScales = Sequence[tuple[str, float]]


def canonical_state(module: torch.nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """A module's parameters (and buffers) under its checkpoint's names: peft's ``base_layer``
    wrappers seen through, adapter tensors (LoRA, IP-Adapter) left out."""
    state: dict[str, torch.Tensor] = {}
    tensors = itertools.chain(module.named_parameters(), module.named_buffers() if buffers else ())
    for name, tensor in tensors:
        if not _ADAPTER_TENSOR.search(name):
            state[name.replace(_BASE_LAYER, ".")] = tensor
    return state


# peft keeps each adapter's layers in torch dicts under its name: a name that is already an
# attribute of those dicts ("train", "to", "keys", "training"...) is refused there with a KeyError.
_PEFT_DICTS = (torch.nn.ModuleDict(), torch.nn.ParameterDict())


def check_name(name: str) -> None:
    """INVALID_ARGUMENT on ``name`` unless peft can load an adapter by that name."""
    problem = adapter_name_problem(name)
    if problem is None and any(hasattr(holder, name) for holder in _PEFT_DICTS):
        problem = f"{name!r} is a name torch modules use; choose another"
    if problem is not None:
        raise invalid_argument({"name": problem})


@dataclass
class Adapter:
    name: str
    path: Path
    digest: str
    pinned: bool
    components: list[str] = field(default_factory=list)
    parameter_bytes: int = 0
    resident: bool = False
    last_used: int = 0
    requests: int = 0

    def info(self) -> common_pb2.AdapterInfo:
        return common_pb2.AdapterInfo(name=self.name, path=str(self.path), pinned=self.pinned,
                                      components=self.components, digest=self.digest, resident=self.resident,
                                      parameter_bytes=self.parameter_bytes, requests=self.requests)


# Reads an adapter file: its tensors and the digest of its bytes.
ReadTensors = Callable[[Path], tuple[dict[str, torch.Tensor], str]]


def _no_files(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    raise failed_precondition("this runner takes no adapters")


class AdapterSet:
    """The adapters registered on this runner's model, and which of them are on the device."""

    def __init__(self, max_resident: int = 0, read: ReadTensors | None = None) -> None:
        self.max_resident = max_resident
        self._read = read or _no_files
        self.registered: dict[str, Adapter] = {}
        self._clock = itertools.count(1)
        self._active: tuple[tuple[str, float], ...] | None = None  # None: unknown, set again next batch

    def resident(self) -> list[Adapter]:
        return [adapter for adapter in self.registered.values() if adapter.resident]

    def register(self, pipeline: Any, source: AdapterSource, files: SourceFiles | None = None,
                 before_change: Callable[[], None] = lambda: None) -> Adapter:
        """Reads an adapter file and loads it; nothing changes when it does not fit the model.
        ``files``: unused, the set reads by its own ``read`` (``--max-weights-bytes``)."""
        name, path, pin, expected_digest = source.name, source.path, source.pin, source.expected_digest
        check_name(name)
        if not hasattr(pipeline, "load_lora_weights"):
            raise failed_precondition(f"{type(pipeline).__name__} takes no LoRA adapters")
        existing = self.registered.get(name)
        if existing is not None and existing.path != path:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"adapter {name!r} is registered from {existing.path}; unload it first")
        tensors, digest = self._read(path)
        if expected_digest and digest != expected_digest:
            raise failed_precondition(f"adapter {name!r} at {path} changed since it was registered; nothing loaded")
        if existing is not None and existing.digest == digest:
            existing.pinned = pin
            return existing
        pinned = sum(a.pinned for a in self.registered.values() if a.name != name) + pin
        if pinned > self.max_resident:
            raise failed_precondition(f"{self.max_resident} adapters may be resident (--max-adapters) and "
                                      f"{pinned - pin} are pinned; unpin or unload one first")
        before_change()
        if existing is not None:
            self._unload(pipeline, existing)
            del self.registered[name]
        adapter = Adapter(name, path, digest, pin)
        self._make_room(pipeline, keep=())
        self._load(pipeline, adapter, tensors)
        self.registered[name] = adapter
        logger.info("adapter %s registered from %s: %s, %d bytes%s", name, path, adapter.components,
                    adapter.parameter_bytes, " (pinned)" if pin else "")
        return adapter

    def unregister(self, pipeline: Any, name: str) -> None:
        adapter = self.registered.get(name)
        if adapter is None:
            raise not_found(f"adapter {name!r} is not registered")
        self._unload(pipeline, adapter)
        del self.registered[name]
        logger.info("adapter %s unloaded", name)

    def check_batch(self, wanted: AdapterScales) -> None:
        """INVALID_ARGUMENT for an unknown adapter, a repeated one, or more than can be resident."""
        violations = {}
        names = [name for name, _ in wanted]
        for index, name in enumerate(names):
            if name not in self.registered:
                violations[f"adapters[{index}].name"] = f"adapter {name!r} is not registered"
            elif names.index(name) != index:
                violations[f"adapters[{index}].name"] = f"adapter {name!r} appears twice"
        if len(set(names)) > self.max_resident:
            violations["adapters"] = f"at most {self.max_resident} adapters at once (--max-adapters)"
        if violations:
            raise invalid_argument(violations)

    def activate(self, pipeline: Any, wanted: AdapterScales) -> None:
        """Makes exactly ``wanted`` active for the next pipeline call: evicted adapters load again
        (least recently used unpinned ones make room), and no adapters means LoRA off."""
        self.check_batch(wanted)
        names = [name for name, _ in wanted]
        for name in names:
            adapter = self.registered[name]
            adapter.last_used = next(self._clock)
            adapter.requests += 1
            if not adapter.resident:
                tensors, digest = self._read(adapter.path)
                if digest != adapter.digest:
                    raise failed_precondition(f"adapter {name!r} at {adapter.path} changed since it was registered; "
                                              "load it again with LoadAdapter")
                self._make_room(pipeline, keep=names)
                self._load(pipeline, adapter, tensors)
        key = tuple(wanted)
        if key == self._active or not self.resident() and not key:
            return
        if key:
            pipeline.enable_lora()
            pipeline.set_adapters(names, adapter_weights=[scale for _, scale in wanted])
        else:
            pipeline.disable_lora()
        self._active = key

    def evict_all(self, pipeline: Any) -> None:
        """Takes every adapter off the device (they stay registered and load again on demand),
        restoring the modules' own layers (before a level-2 sleep, which reloads them by name)."""
        if not self.resident():
            return
        pipeline.unload_lora_weights()
        for adapter in self.resident():
            adapter.resident = False
        self._active = None
        logger.info("adapters evicted from the device")

    def _make_room(self, pipeline: Any, keep: Sequence[str]) -> None:
        while len(self.resident()) >= self.max_resident:
            candidates = [a for a in self.resident() if not a.pinned and a.name not in keep]
            if not candidates:
                raise failed_precondition(f"no adapter can be evicted: {self.max_resident} resident "
                                          "(--max-adapters) are pinned or in this batch")
            victim = min(candidates, key=lambda a: a.last_used)
            self._unload(pipeline, victim)
            logger.info("adapter %s evicted (least recently used)", victim.name)

    def _load(self, pipeline: Any, adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
        before = _adapters_by_component(pipeline)
        try:
            pipeline.load_lora_weights(dict(tensors), adapter_name=adapter.name)
            components = sorted(c for c, names in _adapters_by_component(pipeline).items()
                                if adapter.name in names and adapter.name not in before.get(c, []))
            if not components:
                raise ValueError("none of its tensors matches a layer of this model")
            unusable = _first_non_finite_layer(pipeline, adapter.name, components)
        except Exception as error:  # noqa: BLE001 - any failure: undo and refuse
            self._delete(pipeline, adapter.name)
            raise failed_precondition(f"adapter {adapter.name!r} does not fit {type(pipeline).__name__}: "
                                      f"{short_reason(error)}; nothing changed") from None
        if unusable is not None:
            self._delete(pipeline, adapter.name)
            raise invalid_argument({"path": f"adapter {adapter.name!r}: {unusable}; nothing loaded"})
        adapter.components = components
        adapter.parameter_bytes = sum(
            tensor.numel() * tensor.element_size()
            for name in components for key, tensor in getattr(pipeline, name).named_parameters()
            if f".{adapter.name}." in f".{key}.")
        adapter.resident = True
        self._active = None

    def _unload(self, pipeline: Any, adapter: Adapter) -> None:
        """Takes one adapter off the device; with the last one, peft's wrappers go too, restoring
        the modules' own layers: a level-2 sleep reloads weights by their checkpoint names, which a
        wrapped module (``to_q.base_layer.weight``) no longer has."""
        if adapter.resident:
            self._delete(pipeline, adapter.name)
            adapter.resident = False
            self._active = None
            if not self.resident():
                pipeline.unload_lora_weights()

    @staticmethod
    def _delete(pipeline: Any, name: str) -> None:
        if any(name in names for names in _adapters_by_component(pipeline).values()):
            pipeline.delete_adapters([name])


def _lora_layers(pipeline: Any, name: str, components: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """Every layer of ``components`` that adapter ``name`` adapts (a peft ``LoraLayer``: its
    Linear, Conv or Embedding kind has ``get_delta_weight``), with its full name."""
    for component in components:
        for layer_name, module in getattr(pipeline, component).named_modules():
            if isinstance(module, LoraLayer) and name in module.r:
                yield f"{component}.{layer_name}", module


def _first_non_finite_layer(pipeline: Any, name: str, components: Sequence[str]) -> str | None:
    """What makes adapter ``name`` unusable, naming its first such layer: a LoRA tensor holding NaN
    or an infinity, or an update (scaling x B @ A) that overflows the layer's dtype; None if none.

    Each element of the update sums rank products, so it is at most scaling x rank x max|A| x
    max|B|: two reductions per layer clear it when that bound fits the dtype, and only a layer
    whose bound does not is computed in full."""
    with torch.no_grad():
        for layer_name, layer in _lora_layers(pipeline, name, components):
            if name in layer.lora_A:
                tensors: dict[str, torch.Tensor] = {"lora_A": layer.lora_A[name].weight,
                                                    "lora_B": layer.lora_B[name].weight}
            else:
                tensors = {"lora_A": layer.lora_embedding_A[name], "lora_B": layer.lora_embedding_B[name]}
            bound = abs(float(layer.scaling[name])) * layer.r[name]
            for tensor in tensors.values():
                bound *= float(tensor.abs().max())
            if bound < torch.finfo(tensors["lora_A"].dtype).max:  # False for NaN too
                continue
            for kind, tensor in tensors.items():
                if not bool(torch.isfinite(tensor).all()):
                    return f"{layer_name}.{kind} holds NaN or infinite values"
            if not bool(torch.isfinite(layer.get_delta_weight(name)).all()):
                return f"the update of {layer_name} (scaling x lora_B @ lora_A) overflows {tensors['lora_A'].dtype}"
    return None


def _adapters_by_component(pipeline: Any) -> dict[str, list[str]]:
    listed: dict[str, list[str]] = pipeline.get_list_adapters()
    return listed
