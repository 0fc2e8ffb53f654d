"""The acceleration a model is asked to load with, as one typed value (the protocol's
``Acceleration`` message, checked for its own consistency; what the model and the platform can take
is checked by ``runner_service.acceleration.apply``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diffusion.v1 import common_pb2
from serving_common.errors import invalid_argument
from serving_common.input_rules import acceleration_violations, with_cache_defaults


@dataclass(frozen=True)
class AccelerationPlan:
    """What to apply at load; every field unset (the default) is plain diffusers."""

    cache: str = ""
    cache_threshold: float = 0.0
    cache_warmup_steps: int = 0
    compile: bool = False
    quantization: str = ""
    attention_backend: str = ""

    @classmethod
    def from_proto(cls, message: common_pb2.Acceleration) -> AccelerationPlan:
        """The message's plan, a cache's threshold of 0 taking the method's default
        (``with_cache_defaults``); INVALID_ARGUMENT naming the field where it contradicts itself."""
        violations = acceleration_violations(message)
        if violations:
            raise invalid_argument(violations)
        message = with_cache_defaults(message)
        return cls(**{field.name: getattr(message, field.name) for field in dataclasses.fields(cls)})

    def to_proto(self) -> common_pb2.Acceleration:
        return common_pb2.Acceleration(**dataclasses.asdict(self))

    @property
    def plain(self) -> bool:
        return self == AccelerationPlan()
