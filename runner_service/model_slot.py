"""The runner's one loaded model, and the policy for replacing it (LoadModel).

A new model is loaded next to the current one and swapped in, so a failed load leaves the
current one serving. Where the device (or host memory) cannot hold both, the current one is
unloaded first, and loaded back from its source if the new one then fails.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from runner_service.adapters import AdapterSet
from runner_service.controlnets import ControlNets
from runner_service.device_gate import CallWatch
from runner_service.loaded_model import (
    DeviceOutOfMemory,
    LoadedModel,
    ModelSource,
    check_load,
    describe,
    load_model,
)
from runner_service.model_extras import LoadOptions
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache
from runner_service.platforms import Platform
from runner_service.sleep import SleepController
from serving_common.errors import ServiceError, failed_precondition
from serving_common.input_rules import AccelerationPlan

logger = logging.getLogger(__name__)


class ModelSlot:
    """Holds the loaded model (or none) and what sleeping keeps of it, and replaces it.

    ``check`` runs anywhere; ``replace`` runs on the device thread, the device held alone.
    ``new_adapters`` makes each new model's (empty) adapter set, ``new_controlnets`` its (empty)
    ControlNet store; ``hub`` is where Hugging Face
    ids are found; ``single_file_configs`` are the diffusers models single-file checkpoints take
    their configs from (``--single-file-config``).
    """

    def __init__(self, platform: Platform, model_cache: Path | None, roots: ModelRoots,
                 new_adapters: Callable[[], AdapterSet], hub: HubCache,
                 single_file_configs: Sequence[str] = (), new_controlnets: Callable[[], ControlNets] = ControlNets
                 ) -> None:
        self.platform = platform
        self.model_cache = model_cache
        self.roots = roots
        self.hub = hub
        self.single_file_configs = tuple(single_file_configs)
        self.model: LoadedModel | None = None
        self.sleeper = SleepController(platform)
        self._new_adapters = new_adapters
        self._new_controlnets = new_controlnets

    def require(self) -> LoadedModel:
        if self.model is None:
            raise failed_precondition("no model loaded; call LoadModel")
        return self.model

    def check(self, source: str, options: LoadOptions | None = None) -> ModelSource:
        """Checks a source, and its overrides and adapters to fuse, before the device is held or
        anything is unloaded (a built-in may be built here)."""
        return check_load(source, options or LoadOptions(), self.single_file_configs, self.model_cache, self.roots,
                          self.hub)

    def replace(self, checked: ModelSource, dtype_name: str | None, plan: AccelerationPlan, watch: CallWatch) -> None:
        """Loads the new model alongside the current one and swaps them; where the device cannot
        hold both, unloads the current one first and puts it back if the new one fails. ``plan``
        was checked against the platform's offer; what the model's family cannot take is refused
        by ``load_model``."""
        if self.model is not None and not self.platform.fits_alongside(2 * checked.file_bytes):
            logger.warning("%s may not fit in memory next to %s: unloading that first", checked.source,
                           self.model.source)
            self._replace_unloading_first(checked, dtype_name, plan, watch)
            return
        too_big = ""
        try:
            model = load_model(checked, dtype_name, self.platform, self._new_adapters(), plan, self._new_controlnets())
        except DeviceOutOfMemory as error:
            if self.model is None:
                raise failed_precondition(f"{checked.source!r} does not fit in the device's memory: {error}") from None
            too_big = str(error)
        if too_big:
            logger.warning("%s does not fit next to %s (%s): unloading that first", checked.source,
                           self.model.source if self.model else "-", too_big)
            self._replace_unloading_first(checked, dtype_name, plan, watch)
            return
        try:
            watch.before_change()
        except ServiceError:
            del model
            self.free_memory()
            raise
        self.install(model)

    def load_beside(self, checked: ModelSource, dtype_name: str | None, plan: AccelerationPlan) -> LoadedModel:
        """A runner group's load (every rank loads, then all switch or none): the new model beside
        the current one, which keeps serving; FAILED_PRECONDITION where the device cannot hold
        both (a group never unloads first: the other ranks could not be put back)."""
        try:
            return load_model(checked, dtype_name, self.platform, self._new_adapters(), plan, self._new_controlnets())
        except DeviceOutOfMemory as error:
            beside = f" next to {self.model.source!r}" if self.model is not None else ""
            raise failed_precondition(f"{checked.source!r} does not fit in the device's memory{beside}: {error}"
                                      ) from None

    def install(self, model: LoadedModel) -> None:
        """Switches to ``model`` and frees the one it replaces."""
        previous, self.model = self.model, model
        del model
        if previous is not None:
            self.sleeper.forget(previous)
            del previous
            self.free_memory()

    def free_memory(self) -> None:
        """Hands back what models released (callers drop their references first)."""
        gc.collect()
        self.platform.empty_cache()
        self.platform.release_host_memory()

    def _replace_unloading_first(self, checked: ModelSource, dtype_name: str | None, plan: AccelerationPlan,
                                 watch: CallWatch) -> None:
        previous = self.model
        if previous is None:
            raise AssertionError("nothing to unload")
        source, dtype, previous_plan, options = (previous.source, previous.dtype_name, previous.acceleration,
                                                 previous.extras.options)
        self.sleeper.forget(previous)
        self.model = None
        del previous
        self.free_memory()
        code, failure = grpc.StatusCode.FAILED_PRECONDITION, ""
        model: LoadedModel | None = None
        try:
            model = load_model(checked, dtype_name, self.platform, self._new_adapters(), plan, self._new_controlnets())
            watch.before_change()
        except Exception as error:  # noqa: BLE001 - reported with what became of the previous model
            logger.warning("loading %s failed after unloading %s", checked.source, source, exc_info=True)
            if isinstance(error, ServiceError):
                code = error.code
            failure = describe(error)
        if not failure and model is not None:
            self.model = model
            return
        # Outside the except block nothing holds what the failed load allocated any more.
        model = None
        self.free_memory()
        raise ServiceError(code, f"{failure}; {self._reload(source, dtype, previous_plan, options)}")

    def _reload(self, source: str, dtype_name: str, plan: AccelerationPlan, options: LoadOptions) -> str:
        """Loads the model that was unloaded for one that then failed; says how that went."""
        try:
            self.model = load_model(self.check(source, options), dtype_name, self.platform, self._new_adapters(), plan,
                                    self._new_controlnets())
        except Exception as error:  # noqa: BLE001 - the runner stays up, with no model
            logger.error("cannot reload the previous model %s: %s", source, describe(error))
            return f"the previous model {source!r} could not be loaded back ({describe(error)}); no model is loaded"
        logger.warning("reloaded the previous model %s from its source; its weight updates were dropped", source)
        return f"the previous model {source!r} was loaded back from its source, without its weight updates"
