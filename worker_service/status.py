"""GetStatus, built in one place from the parts that own each fact."""

from __future__ import annotations

import time

from diffusion.v1 import common_pb2, worker_pb2
from worker_service.config import Limits
from worker_service.controller import ModelController
from worker_service.generation_defaults import defaults_in_force
from worker_service.idle import IdleSleeper
from worker_service.lifecycle import Lifecycle
from worker_service.metrics import WorkerMetrics
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.scheduling.admission import AdmissionQueue
from worker_service.scheduling.dispatcher import Dispatcher
from worker_service.served_names import ServedNames


class StatusReporter:
    def __init__(self, lifecycle: Lifecycle, pool: RunnerPool, queue: AdmissionQueue, dispatcher: Dispatcher,
                 metrics: WorkerMetrics, idle: IdleSleeper, controller: ModelController, served: ServedNames,
                 limits: Limits) -> None:
        self._lifecycle = lifecycle
        self._controller = controller
        self._pool = pool
        self._queue = queue
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._idle = idle
        self._served = served
        self._limits = limits

    def status(self) -> worker_pb2.GetStatusResponse:
        lifecycle = self._lifecycle
        model = lifecycle.model
        return worker_pb2.GetStatusResponse(
            state=lifecycle.state,
            message=lifecycle.message,
            model=model,
            served_model_names=self._served.of(model),
            defaults=defaults_in_force(model, self._limits),
            sleep_level=lifecycle.sleep_level,
            sleeping_components=lifecycle.sleeping_components,
            runners=[self.runner_status(r) for r in self._pool.runners],
            queue_depth=len(self._queue),
            requests_in_flight=self._dispatcher.in_flight,
            weights_version=lifecycle.weights_version,
            statistics=self._metrics.statistics(),
            idle_sleep_after_s=self._idle.after_s,
            last_sleep_idle=self._idle.last_sleep_idle,
            active_requests=self.active_requests(),
            adapters=self.adapters(),
            weights_checksum=next((r.info.weights_checksum for r in self._pool.ready()
                                   if r.info is not None and r.info.weights_checksum), ""),
        )

    def adapters(self) -> list[common_pb2.AdapterInfo]:
        """The registered adapters as the runners hold them; requests counted by this worker."""
        desired = self._controller.desired
        found = []
        for registered in desired.adapters if desired is not None else []:
            held = [a for r in self._pool.runners if r.info is not None for a in r.info.adapters
                    if a.name == registered.name]
            found.append(common_pb2.AdapterInfo(
                name=registered.name, path=registered.path, pinned=registered.pin, digest=registered.digest,
                kind=registered.kind,  # type: ignore[arg-type]
                components=held[0].components if held else [], resident=any(a.resident for a in held),
                parameter_bytes=max((a.parameter_bytes for a in held), default=0),
                requests=self._metrics.stats.adapter_requests[registered.name]))
        return found

    def adapter(self, name: str) -> common_pb2.AdapterInfo | None:
        return next((a for a in self.adapters() if a.name == name), None)

    def active_requests(self) -> list[worker_pb2.ActiveRequest]:
        """Queued requests in queue order, then the running and encoding ones, oldest first."""
        now = time.monotonic()
        queued = self._queue.jobs
        others = sorted((j for j in self._queue.active.values() if j not in queued), key=lambda j: j.admitted_at)
        return [worker_pb2.ActiveRequest(
            request_id=job.request.request_id,
            state="queued" if job in queued else "running" if job.batch is not None else "encoding",
            position=max(job.position, 0) if job in queued else 0,
            step=job.step if job.batch is not None else 0, total_steps=job.request.num_inference_steps,
            age_ms=(now - job.admitted_at) * 1000) for job in [*queued, *others]]

    def runner_status(self, runner: RunnerHandle) -> worker_pb2.RunnerStatus:
        return worker_pb2.RunnerStatus(target=runner.target, connected=runner.connected, info=runner.info,
                                       restarts=runner.restarts, ready=runner.ready,
                                       requests_in_flight=runner.in_flight)
