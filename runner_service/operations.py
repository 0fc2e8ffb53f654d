"""The runner's device operations that change a loaded model, one class each: its arguments, how it
runs on one device, and how it is undone.

``ModelHost`` runs each with the device held alone: on its one device, or on a runner group's every
rank, where ``group/operations.py`` broadcasts the same object and each rank runs it on its own host
(``Replicated``), undoing it where another rank failed. Each ``run`` calls ``before_change`` right
before it changes anything: the caller's last chance to have gone (a cancel, a deadline) with
nothing changed; a group's ranks all get the same answer there.

An operation that keeps no copy of what it replaced has no ``undo`` (``UNDOABLE`` is False): where
one rank alone failed it, the group ends rather than serve from mismatched ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

import grpc
import torch

from diffusion.v1 import common_pb2
from runner_service.adapter_stores import AdapterSource, RegisteredAdapter
from runner_service.model_roots import ModelRoots
from runner_service.model_slot import ModelSlot
from runner_service.sleep import SleepReport
from runner_service.weights import WeightsLoaded, apply_tensors, load_weights, weights_checksum
from serving_common.conditioning_rules import kind_words
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, not_found

BeforeChange = Callable[[], None]
Result = TypeVar("Result", covariant=True)


def nothing() -> None:
    """A ``before_change`` with no caller behind it (an undo)."""


class Host(Protocol):
    """What an operation works on: one device's model slot, the roots files are read from, and how
    many bytes of weights one call may bring."""

    @property
    def slot(self) -> ModelSlot: ...

    @property
    def roots(self) -> ModelRoots: ...

    def weights_budget(self) -> int: ...


class DeviceOperation(Protocol[Result]):
    """One operation on the loaded model (a frozen dataclass of its arguments)."""

    NAME: ClassVar[str]  # the RunnerService method, as errors and logs name it
    UNDOABLE: ClassVar[bool]

    def run(self, host: Host, before_change: BeforeChange) -> Result: ...

    def undo(self, host: Host) -> None: ...


class _Permanent:
    """An operation that keeps no copy of what it replaced (that would double the weights' memory)."""

    NAME: ClassVar[str]
    UNDOABLE: ClassVar[bool] = False

    def undo(self, host: Host) -> None:
        raise NotImplementedError(f"{self.NAME} keeps no copy of what it replaced, so it cannot be undone")


@dataclass(frozen=True)
class Sleep:
    """Offloads (level 1) or discards (level 2) the tagged components (all when none)."""

    level: int
    tags: tuple[str, ...]
    NAME: ClassVar[str] = "Sleep"
    UNDOABLE: ClassVar[bool] = True

    def run(self, host: Host, before_change: BeforeChange) -> SleepReport:
        model = host.slot.require()
        if self.level == 2 and model.adapters.resident():
            # Level 2 reloads weights by their checkpoint names: take peft's wrappers off first.
            if model.asleep_components():
                raise failed_precondition("wake the model before a level-2 sleep while adapters are resident")
            before_change()
            model.adapters.evict_all(model.pipeline)
        if self.level == 2 and model.ip_adapters.resident():
            before_change()  # the UNet's own parameters again: IP-Adapters load again when a batch needs them
            model.ip_adapters.evict_all(model.pipeline)
        report = host.slot.sleeper.sleep(model, self.level, list(self.tags), before_change)
        if self.level == 2 and not self.tags:  # the whole model's weights dropped: its ControlNets' too
            model.controlnets.free_all()
        return report

    def undo(self, host: Host) -> None:
        WakeUp(self.tags).run(host, nothing)


@dataclass(frozen=True)
class WakeUp(_Permanent):
    """Wakes the tagged components (all when none); its result is the weight bytes restored."""

    tags: tuple[str, ...]
    NAME: ClassVar[str] = "WakeUp"

    def run(self, host: Host, before_change: BeforeChange) -> int:
        model = host.slot.require()
        model.forget_cached_rows()
        restored = host.slot.sleeper.wake(model, list(self.tags), before_change)
        if not model.asleep_components():
            model.controlnets.restore(model.pipeline)
        return restored


@dataclass(frozen=True)
class LoadWeights(_Permanent):
    """Copies a safetensors file's (or directory's) tensors into the model, all or nothing; ``path``
    was checked against the model roots."""

    path: Path
    expected_digest: str
    NAME: ClassVar[str] = "LoadWeights"

    def run(self, host: Host, before_change: BeforeChange) -> WeightsLoaded:
        model = host.slot.require()
        model.forget_cached_rows()
        return load_weights(model, self.path, host.roots, host.weights_budget(), self.expected_digest,
                            before_change)


@dataclass(frozen=True)
class PushWeights(_Permanent):
    """Applies a PushWeights stream's tensors, all or nothing; its result is what was loaded and the
    weights' checksum after it. On a group the tensors travel apart from the operation
    (``group/operations.Push``), one broadcast each."""

    tensors: dict[str, torch.Tensor]
    digest: str
    NAME: ClassVar[str] = "PushWeights"

    def run(self, host: Host, before_change: BeforeChange) -> tuple[WeightsLoaded, str]:
        model = host.slot.require()
        model.forget_cached_rows()
        loaded = apply_tensors(model, self.tensors, self.digest, before_change, pushed=True)
        return loaded, weights_checksum(model)


@dataclass(frozen=True)
class LoadAdapter:
    """Registers an adapter of ``kind`` (``common_pb2.AdapterKind``; unset is a LoRA) in the loaded
    model's store of that kind (``LoadedModel.adapter_stores``), read from ``source.path`` (checked
    against the model roots) within the host's roots and budget. A name is registered as one kind
    at a time: ALREADY_EXISTS where another kind's store holds it."""

    kind: int
    source: AdapterSource
    NAME: ClassVar[str] = "LoadAdapter"
    UNDOABLE: ClassVar[bool] = True

    def run(self, host: Host, before_change: BeforeChange) -> RegisteredAdapter:
        model = host.slot.require()
        model.require_awake()
        stores = model.adapter_stores
        kind = self.kind or common_pb2.ADAPTER_KIND_LORA
        store = stores.get(kind)
        if store is None:
            raise invalid_argument({"kind": f"unknown adapter kind {self.kind}"})
        name = self.source.name
        held = next((other for other, holder in stores.items() if other != kind and name in holder.registered), None)
        if held is not None:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"{name!r} is registered as {kind_words(held)}; unload it first")
        return store.register(model.pipeline, self.source, host, before_change)

    def undo(self, host: Host) -> None:
        UnloadAdapter(self.source.name).run(host, nothing)


@dataclass(frozen=True)
class UnloadAdapter(_Permanent):
    """Unregisters the adapter ``name`` from the store that holds it, whatever its kind."""

    name: str
    NAME: ClassVar[str] = "UnloadAdapter"

    def run(self, host: Host, before_change: BeforeChange) -> None:
        model = host.slot.require()
        before_change()
        store = next((store for store in model.adapter_stores.values() if self.name in store.registered), None)
        if store is None:
            raise not_found(f"adapter {self.name!r} is not registered")
        store.unregister(model.pipeline, self.name)
