"""One request over several devices: CFG-parallel and diffusers' context parallelism (issue 27)."""

from runner_service.parallel.apply import CfgSplit, ParallelRun, apply
from runner_service.parallel.plan import ParallelPlan, check, refusal, world_violations

__all__ = ["CfgSplit", "ParallelPlan", "ParallelRun", "apply", "check", "refusal", "world_violations"]
