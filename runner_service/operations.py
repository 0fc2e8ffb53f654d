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

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

import grpc
import torch

from runner_service.adapters import Adapter
from runner_service.controlnets import ControlNet
from runner_service.ip_adapters import IpAdapter
from runner_service.model_roots import ModelRoots
from runner_service.model_slot import ModelSlot
from runner_service.sleep import SleepReport
from runner_service.weights import WeightsLoaded, apply_tensors, load_weights, weights_checksum
from serving_common.errors import ServiceError, failed_precondition

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
    """Registers a LoRA adapter read from ``path`` (checked against the model roots)."""

    name: str
    path: Path
    pin: bool
    expected_digest: str
    NAME: ClassVar[str] = "LoadAdapter"
    UNDOABLE: ClassVar[bool] = True

    def run(self, host: Host, before_change: BeforeChange) -> Adapter:
        model = host.slot.require()
        model.require_awake()
        _name_free(self.name, model.ip_adapters.registered, "an IP-Adapter")
        _name_free(self.name, model.controlnets.registered, "a ControlNet")
        return model.adapters.register(model.pipeline, self.name, self.path, self.pin, self.expected_digest,
                                       before_change)

    def undo(self, host: Host) -> None:
        UnloadAdapter(self.name).run(host, nothing)


@dataclass(frozen=True)
class UnloadAdapter(_Permanent):
    name: str
    NAME: ClassVar[str] = "UnloadAdapter"

    def run(self, host: Host, before_change: BeforeChange) -> None:
        model = host.slot.require()
        before_change()
        if self.name in model.controlnets.registered:
            model.controlnets.unregister(self.name)
            return
        if self.name in model.ip_adapters.registered:
            model.ip_adapters.unregister(model.pipeline, self.name)
        else:
            model.adapters.unregister(model.pipeline, self.name)


@dataclass(frozen=True)
class LoadIpAdapter:
    """Registers an IP-Adapter directory at ``path`` (checked against the model roots) with its
    image encoder (``ip_adapters.py``)."""

    name: str
    path: Path
    expected_digest: str
    NAME: ClassVar[str] = "LoadAdapter"
    UNDOABLE: ClassVar[bool] = True

    def run(self, host: Host, before_change: BeforeChange) -> IpAdapter:
        model = host.slot.require()
        model.require_awake()
        _name_free(self.name, model.adapters.registered, "a LoRA")
        _name_free(self.name, model.controlnets.registered, "a ControlNet")
        return model.ip_adapters.register(model.pipeline, self.name, self.path, host.roots, host.weights_budget(),
                                          self.expected_digest, before_change)

    def undo(self, host: Host) -> None:
        UnloadAdapter(self.name).run(host, nothing)


def _name_free(name: str, registered: Collection[str], kind: str) -> None:
    """ALREADY_EXISTS where ``name`` is registered as another kind of adapter."""
    if name in registered:
        raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"{name!r} is registered as {kind}; unload it first")


@dataclass(frozen=True)
class LoadControlNet:
    """Registers a ControlNet directory at ``path`` (checked against the model roots) for the model's
    family (``controlnets.py``)."""

    name: str
    path: Path
    pin: bool
    expected_digest: str
    NAME: ClassVar[str] = "LoadAdapter"
    UNDOABLE: ClassVar[bool] = True

    def run(self, host: Host, before_change: BeforeChange) -> ControlNet:
        model = host.slot.require()
        model.require_awake()
        _name_free(self.name, [*model.adapters.registered, *model.ip_adapters.registered], "another kind of adapter")
        return model.controlnets.register(model.pipeline, self.name, self.path, self.pin, self.expected_digest,
                                          before_change)

    def undo(self, host: Host) -> None:
        UnloadAdapter(self.name).run(host, nothing)
