"""One request over several devices: CFG-parallel and diffusers' context parallelism (issue 27)."""

from runner_service.parallel.apply import CfgSplit, apply
from runner_service.parallel.plan import CfgLayout, ParallelPlan, check

__all__ = ["CfgLayout", "CfgSplit", "ParallelPlan", "apply", "check"]
