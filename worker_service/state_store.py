"""Keeps the desired state in a JSON file (``--state-file``), so a restarted worker restores the
model, its weight updates, adapters and sleep state on its runners instead of forgetting them.

The file is replaced atomically (written beside it, then renamed), so a crash leaves the old or
the new state, never half of one. A file that cannot be read is reported and ignored.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from google.protobuf import json_format

from diffusion.v1 import common_pb2
from worker_service.desired_state import DesiredState, RegisteredAdapter, WeightUpdate

logger = logging.getLogger(__name__)


class StateStore:
    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None

    def load(self) -> DesiredState | None:
        """The state saved last, or None (no file configured, none written yet, or unreadable)."""
        if self.path is None or not self.path.exists():
            return None
        try:
            raw = json.loads(self.path.read_text())
            # Parsed here, so a file whose acceleration or parallelism no longer parses is ignored as a
            # whole; one written before either existed loads without it.
            acceleration = json_format.ParseDict(raw.get("acceleration", {}), common_pb2.Acceleration())
            parallel = json_format.ParseDict(raw.get("parallel", {}), common_pb2.Parallelism())
            state = DesiredState(
                model=str(raw["model"]), dtype=int(raw["dtype"]),
                acceleration=DesiredState.mapping_of(acceleration), parallel=DesiredState.mapping_of(parallel),
                component_overrides=[DesiredState.mapping_of(json_format.ParseDict(o, common_pb2.ComponentOverride()))
                                     for o in raw.get("component_overrides", [])],
                fused_adapters=[DesiredState.mapping_of(json_format.ParseDict(f, common_pb2.FusedAdapter()))
                                for f in raw.get("fused_adapters", [])],
                weight_updates=[WeightUpdate(str(u["path"]), str(u["digest"]), bool(u.get("pushed", False)),
                                             tuple(str(n) for n in u.get("names", ())))
                                for u in raw["weight_updates"]],
                adapters=[RegisteredAdapter(str(a["name"]), str(a["path"]), bool(a["pin"]), str(a["digest"]),
                                            _adapter_kind(a.get("kind", 0))) for a in raw.get("adapters", [])],
                sleep_level=int(raw["sleep_level"]), sleep_tags=[str(t) for t in raw["sleep_tags"]],
                revision=str(raw.get("revision", "")))
        except (OSError, ValueError, KeyError, TypeError, json_format.ParseError) as error:
            logger.error("ignoring the state file %s: %s", self.path, error)
            return None
        logger.info("restored the desired state from %s: model %s, %d weight update(s), %d adapter(s), "
                    "sleep level %d", self.path, state.load_source, len(state.weight_updates), len(state.adapters),
                    state.sleep_level)
        return state

    def save(self, state: DesiredState | None) -> None:
        if self.path is None:
            return
        text = json.dumps(asdict(state) if state is not None else None, indent=1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(handle, "w") as file:
                file.write(text)
            os.replace(temporary, self.path)
        except OSError as error:
            Path(temporary).unlink(missing_ok=True)
            logger.error("could not save the desired state to %s: %s", self.path, error)


def _adapter_kind(value: object) -> int:
    """An adapter's kind as the file holds it (a file from before kinds has none: a LoRA); one this
    version does not know makes the file unreadable, as any other bad value does."""
    if not isinstance(value, int) or value not in common_pb2.AdapterKind.values():
        raise ValueError(f"unknown adapter kind {value!r}")
    return value
