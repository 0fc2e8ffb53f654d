"""The samplers a request may name (GenerateRequest.sampler): each a diffusers scheduler class with
its flags, built ``from_config`` of the model's own scheduler config, so that an image is the one
diffusers' pipeline makes with ``pipe.scheduler = Cls.from_config(pipe.scheduler.config, **flags)``.

Which of them a model offers (``ModelCapabilities.samplers``) follows from its scheduler's config:

- a flow-matching scheduler (a ``FlowMatch...`` class, flow sigmas or a ``flow_prediction``
  config: SD3, Flux, Qwen-Image, Sana, Wan...) offers ``FLOW_SAMPLERS``: ``euler`` (diffusers'
  FlowMatchEulerDiscreteScheduler) and the multistep solvers with flow sigmas;
- a noise- or velocity-predicting one (``prediction_type`` epsilon or v_prediction) offers
  ``SAMPLERS``, except that the samplers which scale the model's input by their sigmas (Euler, Heun,
  LMS, DPM2: ``scaled``) need a pipeline whose call scales it (``scale_model_input``): Kandinsky 3's
  does not, so it would denoise unscaled inputs;
- any other (Würstchen's ratios) offers none.

and of those, the ones whose schedule dry-runs (``schedule_runs``); the pipeline adapter's canary
then keeps only those the pipeline's own call runs (``PipelineAdapter.canary``). A request leaving
``sampler`` unset gets the model's own scheduler.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_euler_ancestral_discrete import EulerAncestralDiscreteScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_heun_discrete import HeunDiscreteScheduler
from diffusers.schedulers.scheduling_k_dpm_2_ancestral_discrete import KDPM2AncestralDiscreteScheduler
from diffusers.schedulers.scheduling_k_dpm_2_discrete import KDPM2DiscreteScheduler
from diffusers.schedulers.scheduling_lcm import LCMScheduler
from diffusers.schedulers.scheduling_lms_discrete import LMSDiscreteScheduler
from diffusers.schedulers.scheduling_pndm import PNDMScheduler
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from runner_service.scheduler_memo import BoundedMemo, Unkeyable, frozen


@dataclass(frozen=True)
class Sampler:
    """A diffusers scheduler class and the config flags it is built with."""

    scheduler: type[ConfigMixin]  # a SchedulerMixin too
    flags: dict[str, Any] = field(default_factory=dict)
    scaled: bool = False  # it scales the model's input by its sigma: the pipeline must call scale_model_input

    def built(self, config: Any) -> Any:
        """A new scheduler of this sampler from a model's scheduler ``config``."""
        return self.scheduler.from_config(config, **self.flags)


SAMPLERS: dict[str, Sampler] = {
    "euler": Sampler(EulerDiscreteScheduler, scaled=True),
    "euler_a": Sampler(EulerAncestralDiscreteScheduler, scaled=True),
    "heun": Sampler(HeunDiscreteScheduler, scaled=True),
    "lms": Sampler(LMSDiscreteScheduler, scaled=True),
    "ddim": Sampler(DDIMScheduler),
    "pndm": Sampler(PNDMScheduler),
    "unipc": Sampler(UniPCMultistepScheduler),
    "dpmpp_2m": Sampler(DPMSolverMultistepScheduler),
    "dpmpp_2m_karras": Sampler(DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "dpmpp_2m_sde_karras": Sampler(DPMSolverMultistepScheduler,
                                   {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "dpm2": Sampler(KDPM2DiscreteScheduler, scaled=True),
    "dpm2_a": Sampler(KDPM2AncestralDiscreteScheduler, scaled=True),
    "lcm": Sampler(LCMScheduler),
}

_FLOW = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
FLOW_SAMPLERS: dict[str, Sampler] = {
    "euler": Sampler(FlowMatchEulerDiscreteScheduler),
    "unipc": Sampler(UniPCMultistepScheduler, _FLOW),
    "dpmpp_2m": Sampler(DPMSolverMultistepScheduler, _FLOW),
}

# The prediction types the noise-schedule samplers take.
_PREDICTIONS = ("epsilon", "v_prediction")
# Steps of a sampler's dry run at load.
_DRY_RUN_STEPS = 4


def flow_matching(scheduler: Any) -> bool:
    """Whether the scheduler integrates a flow (its model predicts a velocity along sigmas from 1 to 0)."""
    config = scheduler.config
    return (type(scheduler).__name__.startswith("FlowMatch") or bool(config.get("use_flow_sigmas"))
            or config.get("prediction_type") == "flow_prediction")


def _table(scheduler: Any) -> dict[str, Sampler]:
    """The samplers of the scheduler's kind: flow-matching, noise-schedule or none."""
    if flow_matching(scheduler):
        return FLOW_SAMPLERS
    return SAMPLERS if scheduler.config.get("prediction_type") in _PREDICTIONS else {}


def offered(pipeline: DiffusionPipeline) -> tuple[str, ...]:
    """The samplers of ``pipeline``'s scheduler whose schedules run, in the table's order (see the
    module's docstring): what its canary tries."""
    scheduler = getattr(pipeline, "scheduler", None)
    if not (isinstance(scheduler, SchedulerMixin) and isinstance(scheduler, ConfigMixin)):
        return ()
    scales = _scales_inputs(type(pipeline))
    return tuple(name for name, sampler in _table(scheduler).items()
                 if (scales or not sampler.scaled)
                 and _dry_runs(sampler, scheduler.config, _DRY_RUN_STEPS))


# What a scheduler's class, flags and config alone decide, for any model in this process (see
# ``runner_service.scheduler_memo``): each sampler's scheduler built and never stepped, which
# ``scheduler_for`` copies (``from_config`` reads the class's signature and checks the config again at
# every call, 1.4 ms on the 2-core CPU, per image; a deep copy of one never stepped is the same
# object in a sixth of the time), and the verdicts of its dry runs. A model's own and its 13
# samplers' schedulers, their verdicts and ``scheduler_max_steps``' dry runs (at most 2 x log2 of its
# training steps) are 50 entries at most: this holds several models' configs.
SCHEDULER_FACTS = BoundedMemo(entries=256)


def _key(*parts: object) -> Hashable | None:
    """The memo's key of these parts; None where a config holds something it cannot key by value."""
    try:
        return frozen(parts)
    except Unkeyable:
        return None


def _unused(sampler: Sampler, config: Any) -> Any:
    """The memo's scheduler of ``sampler`` from ``config``, never stepped: not to be handed out."""
    key = _key("unused", sampler.scheduler, sampler.flags, config)
    return sampler.built(config) if key is None else SCHEDULER_FACTS.get(key, lambda: sampler.built(config))


def _dry_runs(sampler: Sampler, config: Any, steps: int) -> bool:
    """Whether a fresh scheduler of ``sampler`` from ``config`` steps through ``steps`` (``_steps_through``)."""
    def verdict() -> bool:
        return _steps_through(copy.deepcopy(_unused(sampler, config)), steps)

    key = _key("runs", sampler.scheduler, sampler.flags, config, steps)
    return verdict() if key is None else SCHEDULER_FACTS.get(key, verdict)


def scheduler_for(scheduler: Any, sampler: str) -> Any:
    """A new scheduler for one sequence or call: the ``sampler``'s, from ``scheduler``'s config (a
    name ``offered`` lists), or of ``scheduler``'s own class for none (empty)."""
    return copy.deepcopy(_unused(_table(scheduler)[sampler] if sampler else Sampler(type(scheduler)), scheduler.config))


@functools.lru_cache(maxsize=64)  # a class's source read once per process (10 ms for SDXL's)
def _scales_inputs(pipeline: type[DiffusionPipeline]) -> bool:
    """Whether the pipeline class's call scales the denoiser's input by its scheduler
    (``scale_model_input``), as read from its source."""
    try:
        return "scale_model_input" in inspect.getsource(pipeline.__call__)
    except (OSError, TypeError):  # no source to read: not known to
        return False


def schedule_runs(scheduler: Any, steps: int) -> bool:
    """Whether a fresh copy of the scheduler sets ``steps`` timesteps and steps through all of
    them, as a pipeline's call does (a one-element sample, a zero prediction; a dynamic shift's
    ``mu``, which moves the timesteps but not their count, at 1: no shift where it is linear).
    Found once per class and config in this process (``SCHEDULER_FACTS``)."""
    return _dry_runs(Sampler(type(scheduler)), scheduler.config, steps)


def _steps_through(fresh: Any, steps: int) -> bool:
    """``schedule_runs`` of a scheduler never stepped (a copy of the memo's: one build of each
    sampler per config in this process, which the canary's calls copy again; the KDPM2 samplers'
    build sets a schedule of every training step, about 0.2 s each on the 2-core CPU)."""
    try:
        fresh.set_timesteps(steps, **({"mu": 1.0} if fresh.config.get("use_dynamic_shifting") else {}))
        sample = torch.zeros(1, 1, 1, 1)
        for t in fresh.timesteps:
            t = t.reshape(1)
            if hasattr(fresh, "scale_model_input"):
                sample = fresh.scale_model_input(sample, t)
            sample = fresh.step(torch.zeros_like(sample), t, sample, return_dict=False)[0]
    except Exception:  # noqa: BLE001 - whatever it raises, the schedule does not run
        return False
    return True
