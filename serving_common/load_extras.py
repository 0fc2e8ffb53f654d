"""Component overrides and adapters fused at load (InitRequest / LoadModelRequest
.component_overrides and .fused_adapters): how the worker's and the CLI's flags spell them
(``--component vae=PATH_OR_ID``, ``--fuse-lora PATH[:SCALE]``) and the bounds both sides check."""

from __future__ import annotations

from collections.abc import Sequence

from diffusion.v1 import common_pb2
from serving_common.input_rules import text_violations

# Overrides, and adapters to fuse, one load may give (a pipeline has a handful of components).
MAX_EXTRAS = 16


def parse_component(text: str) -> common_pb2.ComponentOverride:
    """``NAME=SOURCE`` (``vae=/models/sd-vae-ft-mse``); ValueError where it is not."""
    name, equals, source = text.partition("=")
    if not equals or not name.strip() or not source.strip():
        raise ValueError(f"{text!r}: expected NAME=SOURCE, e.g. vae=/models/sd-vae-ft-mse")
    return common_pb2.ComponentOverride(name=name.strip(), source=source.strip())


def parse_fused(text: str) -> common_pb2.FusedAdapter:
    """``SOURCE[:SCALE]`` (``/loras/lcm.safetensors:0.8``); the part after the last colon is the
    scale where it reads as a number, else part of the source."""
    source, colon, tail = text.rpartition(":")
    if colon and source:
        try:
            return common_pb2.FusedAdapter(source=source, scale=float(tail))
        except ValueError:
            pass
    if not text:
        raise ValueError("expected PATH[:SCALE], e.g. /loras/lcm.safetensors:0.8")
    return common_pb2.FusedAdapter(source=text)


def extras_violations(overrides: Sequence[common_pb2.ComponentOverride],
                      fused: Sequence[common_pb2.FusedAdapter]) -> list[tuple[str, str]]:
    """What is wrong with the lists, each naming its field: too many, a name or source empty or not
    plain text, a component given twice."""
    violations = [(field, f"{count} given; at most {MAX_EXTRAS}")
                  for field, count in (("component_overrides", len(overrides)), ("fused_adapters", len(fused)))
                  if count > MAX_EXTRAS]
    if violations:
        return violations
    texts = [*((f"component_overrides[{i}].name", o.name) for i, o in enumerate(overrides)),
             *((f"component_overrides[{i}].source", o.source) for i, o in enumerate(overrides)),
             *((f"fused_adapters[{i}].source", f.source) for i, f in enumerate(fused))]
    violations = [(field, "required") for field, text in texts if not text]
    violations.extend(text_violations([(field, text) for field, text in texts if text]))
    names = [o.name for o in overrides]
    violations.extend((f"component_overrides[{i}].name", f"{name!r} is given more than once")
                      for i, name in enumerate(names) if name and names.index(name) != i)
    return violations
