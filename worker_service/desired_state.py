"""What every runner should hold: the model (with its acceleration and parallelism), its weight
updates, its adapters and its sleep state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from diffusion.v1 import common_pb2
from serving_common.hub_ids import HubId
from serving_common.input_rules import with_cache_defaults
from serving_common.protocol import normal_parallel
from serving_common.tensor_stream import still_needed


@dataclass(frozen=True)
class WeightUpdate:
    """One LoadWeights or PushWeights in effect: where it is read from (the path on the runners, or
    the worker's push file), the digest the runner reported for it and the tensors it set."""

    path: str
    digest: str
    pushed: bool = False
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class RegisteredAdapter:
    """One LoadAdapter in effect: where it was read, whether it is pinned, its file's digest and
    its kind (common_pb2.AdapterKind: a LoRA, a ControlNet or an IP-Adapter; unset: a LoRA)."""

    name: str
    path: str
    pin: bool
    digest: str
    kind: int = common_pb2.ADAPTER_KIND_UNSPECIFIED

    @property
    def lora(self) -> bool:
        return self.kind in (common_pb2.ADAPTER_KIND_UNSPECIFIED, common_pb2.ADAPTER_KIND_LORA)


@dataclass
class DesiredState:
    """What every runner should hold; re-applied in this order to a restarted or attached runner."""

    model: str
    dtype: int
    # InitRequest.acceleration as its JSON mapping (the state file's form); empty: none.
    acceleration: dict[str, Any] = field(default_factory=dict)
    # InitRequest.parallel likewise; empty: one device does all of each request.
    parallel: dict[str, Any] = field(default_factory=dict)
    # InitRequest.component_overrides and .fused_adapters likewise, one mapping each (--component, --fuse-lora).
    component_overrides: list[dict[str, Any]] = field(default_factory=list)
    fused_adapters: list[dict[str, Any]] = field(default_factory=list)
    weight_updates: list[WeightUpdate] = field(default_factory=list)
    adapters: list[RegisteredAdapter] = field(default_factory=list)
    sleep_level: int = 0
    sleep_tags: list[str] = field(default_factory=list)
    # The commit a Hugging Face id resolved to on the first runner that loaded it (ModelInfo.revision):
    # every later load asks for that snapshot (``load_source``), so a restarted runner holds the same
    # weights though the branch has moved since. "" for any other source, and until it is known.
    revision: str = ""

    @classmethod
    def loading(cls, model: str, dtype: int, acceleration: common_pb2.Acceleration | None,
                parallel: common_pb2.Parallelism | None,
                overrides: Sequence[common_pb2.ComponentOverride] = (),
                fused: Sequence[common_pb2.FusedAdapter] = ()) -> DesiredState:
        """The state an Init (or --model) asks for: the model alone (with its component overrides and
        fused adapters), without weight updates, adapters or sleep; None: plain, on one device. A
        cache's threshold of 0 is its method's default, as the runner loads it and reports it."""
        return cls(model, dtype, cls.mapping_of(with_cache_defaults(acceleration or common_pb2.Acceleration())),
                   cls.mapping_of(normal_parallel(parallel or common_pb2.Parallelism())),
                   [cls.mapping_of(o) for o in overrides], [cls.mapping_of(f) for f in fused])

    @staticmethod
    def mapping_of(message: Message) -> dict[str, Any]:
        """``message`` in the state file's form: its JSON mapping, under the proto's field names."""
        return json_format.MessageToDict(message, preserving_proto_field_name=True)

    @property
    def load_source(self) -> str:
        """What a runner is asked to load: the model, at its pinned commit where it has one."""
        hub_id = HubId.parse(self.model) if self.revision else None
        return str(hub_id.pinned(self.revision)) if hub_id is not None else self.model

    def pin(self, model: common_pb2.ModelInfo) -> bool:
        """Takes the commit a runner resolved this model to, if none is pinned yet; whether it did."""
        if self.revision or not model.revision or model.source != self.model:
            return False
        self.revision = model.revision
        return True

    def is_model(self, model: common_pb2.ModelInfo) -> bool:
        """Whether a runner's ``model`` is this state's (at its pinned commit, where it has one)."""
        return model.source in (self.model, self.load_source) and (not self.revision or
                                                                   model.revision == self.revision)

    def acceleration_message(self) -> common_pb2.Acceleration:
        return json_format.ParseDict(self.acceleration, common_pb2.Acceleration())

    def parallel_message(self) -> common_pb2.Parallelism:
        return json_format.ParseDict(self.parallel, common_pb2.Parallelism())

    def overrides_message(self) -> list[common_pb2.ComponentOverride]:
        return [json_format.ParseDict(o, common_pb2.ComponentOverride()) for o in self.component_overrides]

    def fused_message(self) -> list[common_pb2.FusedAdapter]:
        return [json_format.ParseDict(f, common_pb2.FusedAdapter()) for f in self.fused_adapters]

    def add_update(self, update: WeightUpdate) -> None:
        """Records ``update``, dropping those it wholly replaces (the runner drops the same ones)."""
        self.weight_updates = still_needed([*self.weight_updates, update])

    def follow(self, info: common_pb2.RunnerInfo, level: int) -> None:
        """Takes the sleep state a runner reports after an operation (asleep at ``level``, if any
        component is), and forgets the updates it no longer holds (a level-2 sleep discards them)."""
        asleep = [c.name for c in info.model.components if c.asleep]
        self.sleep_level, self.sleep_tags = (level if asleep else 0), asleep
        held = {update.digest for update in info.weight_updates}
        self.weight_updates = [u for u in self.weight_updates if u.digest in held]

    def held_by(self, info: common_pb2.RunnerInfo) -> bool:
        """Whether a runner reporting ``info`` holds exactly this state."""
        if not info.HasField("model") or not self.is_model(info.model):
            return False
        if self.dtype != common_pb2.DTYPE_UNSPECIFIED and info.model.dtype != self.dtype:
            return False
        if info.model.acceleration != self.acceleration_message() or info.model.parallel != self.parallel_message():
            return False
        if (list(info.model.component_overrides) != self.overrides_message()
                or list(info.model.fused_adapters) != self.fused_message()):
            return False
        asleep = sorted(c.name for c in info.model.components if c.asleep)
        if asleep != sorted(self.sleep_tags if self.sleep_level else []):
            return False
        if sorted((a.name, a.digest, a.pinned, a.kind or common_pb2.ADAPTER_KIND_LORA) for a in info.adapters) != \
                sorted((a.name, a.digest, a.pin, a.kind or common_pb2.ADAPTER_KIND_LORA) for a in self.adapters):
            return False
        return [u.digest for u in info.weight_updates] == [u.digest for u in self.weight_updates]

    def with_adapter(self, adapter: RegisteredAdapter) -> None:
        self.adapters = [a for a in self.adapters if a.name != adapter.name] + [adapter]

    def without_adapter(self, name: str) -> None:
        self.adapters = [a for a in self.adapters if a.name != name]
