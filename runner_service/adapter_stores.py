"""What every kind of adapter's store has in common (LoRAs ``adapters.py``, ControlNets
``controlnets.py``, IP-Adapters ``ip_adapters.py``), so that LoadAdapter and UnloadAdapter
(``operations.py``) are written once: the loaded model holds one table of its stores by
``common_pb2.AdapterKind`` (``LoadedModel.adapter_stores``), and a new kind of adapter is one
store and one row of that table.

A name belongs to one store at a time: a request that names it in the field of another kind is
refused INVALID_ARGUMENT naming that field (``serving_common.conditioning_rules.wrong_kind``), as
the worker refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from diffusion.v1 import common_pb2
from runner_service.model_roots import ModelRoots


@dataclass(frozen=True)
class AdapterSource:
    """What one LoadAdapter registers: its name, the file or directory it is read from (checked
    against the model roots), whether it stays on the device, and the digest its bytes must still
    have (empty: any)."""

    name: str
    path: Path
    pin: bool = False
    expected_digest: str = ""


class SourceFiles(Protocol):
    """Where a LoadAdapter may read (the host's model roots) and how many bytes at most (the
    host's budget for one call, as LoadWeights'): a store that has no reader of its own reads by
    them."""

    @property
    def roots(self) -> ModelRoots: ...

    def weights_budget(self) -> int: ...


class RegisteredAdapter(Protocol):
    """One registered adapter of any kind, as the runner reports it."""

    @property
    def name(self) -> str: ...

    def info(self) -> common_pb2.AdapterInfo: ...


class AdapterStore(Protocol):
    """The adapters of one kind registered on the loaded model. Its methods run on the device
    thread, under the device lock; ``register`` calls ``before_change`` right before it changes
    anything, and changes nothing when it refuses."""

    @property
    def registered(self) -> Mapping[str, RegisteredAdapter]: ...

    def register(self, pipeline: Any, source: AdapterSource, files: SourceFiles,
                 before_change: Callable[[], None]) -> RegisteredAdapter: ...

    def unregister(self, pipeline: Any, name: str) -> None: ...


def registered_kinds(stores: Mapping[int, AdapterStore]) -> dict[str, int]:
    """Each registered name and the kind (``common_pb2.AdapterKind``) it is registered as."""
    return {name: kind for kind, store in stores.items() for name in store.registered}
