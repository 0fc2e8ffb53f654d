"""Prometheus metrics of the worker and the same statistics for GetStatus.

Served over HTTP on ``--metrics-port`` (default 9090, 0: off), bound to the host of ``--listen``
(``0.0.0.0`` when it is a unix socket), at any path (``/metrics`` by convention):

- ``diffusion_requests_total{method,code}``: finished WorkerService calls by gRPC status code
  (refused ones included: UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...); the OpenAI HTTP API counts
  its calls here too, as method ``http:/v1/...`` (``worker_service.http``).
- ``diffusion_queue_depth``, ``diffusion_requests_in_flight`` (running on a runner) and
  ``diffusion_requests_active`` (Generate calls being handled: queued, running or encoding).
- ``diffusion_requests_receiving`` and ``diffusion_requests_waiting_to_receive``: Generate calls
  receiving their request message, and those waiting for one of ``--max-receiving-requests`` slots
  (``worker_service.receive_gate``).
- ``diffusion_queue_seconds``, ``diffusion_execute_seconds``, ``diffusion_request_seconds``
  (end to end): histograms of successful generations.
- ``diffusion_images_generated_total``, ``diffusion_denoising_steps_total`` (steps per second:
  ``rate(diffusion_denoising_steps_total) / rate(diffusion_execute_seconds_count)`` per request, or
  against ``rate(diffusion_execute_seconds_sum)``).
- ``diffusion_sleep_level`` (0: awake), ``diffusion_worker_state{state}``,
  ``diffusion_idle_sleeps_total``.
- ``diffusion_runner_up{target}``, ``diffusion_runner_restarts_total{target}``,
  ``diffusion_runner_memory_used_bytes{target}`` / ``..._total_bytes`` (from the runner's GetInfo,
  which the runner pool refreshes), ``diffusion_runner_prompt_cache_hits_total{target}``,
  ``..._misses_total`` and ``diffusion_runner_prompt_cache_bytes{target}`` (step-level batching),
  ``diffusion_runner_cache_rows_total{target}`` and ``diffusion_runner_cache_skipped_total{target}``
  (the step cache: denoiser rows run, and those whose blocks after the first were skipped).
- ``diffusion_result_cache_hits_total`` and ``..._misses_total`` (seeded requests answered from
  the result cache, and those it did not hold; ``--result-cache-bytes``), ``diffusion_result_cache_entries``
  and ``diffusion_result_cache_bytes``. A hit counts as a successful generation with its images and
  its end-to-end time, but no queue, execute or phase time and no denoising steps.

Calls are observed by ``ObservingInterceptor``, so the servicer needs no hooks; it never changes
a response.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.protocol import WORKER_SERVICE
from serving_common.server import Context, Continuation, MethodHandler
from worker_service.config import Limits
from worker_service.generation_defaults import defaults_in_force
from worker_service.result_cache import ResultCacheStats, answered_from_memory
from worker_service.runners import RunnerHandle

SERVICE_PREFIX = f"/{WORKER_SERVICE}/"
GENERATE_METHODS = ("Generate", "GenerateStream")
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def metrics_host(listen: str) -> str:
    """The address the metrics port binds: the host of ``--listen``, or 0.0.0.0 for a unix socket."""
    if listen.startswith("unix:") or ":" not in listen:
        return "0.0.0.0"
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host or "0.0.0.0"


@dataclass(frozen=True)
class Sources:
    """Where the scrape-time gauges read from."""

    queue_depth: Callable[[], int]
    in_flight: Callable[[], int]
    state: Callable[[], int]
    sleep_level: Callable[[], int]
    runners: Callable[[], Sequence[RunnerHandle]]
    receiving: Callable[[], int]
    waiting_to_receive: Callable[[], int]
    result_cache: Callable[[], ResultCacheStats] = lambda: ResultCacheStats(0, 0, 0, 0)


@dataclass
class Statistics:
    """Plain counters behind GetStatus's ``statistics``."""

    requests: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    images: int = 0
    generations: int = 0
    queue_ms: float = 0.0
    execute_ms: float = 0.0
    steps: int = 0
    # Successful generations by adapter name.
    adapter_requests: collections.Counter[str] = field(default_factory=collections.Counter)


class WorkerMetrics(Collector):
    """Every metric of one worker, in its own registry (so tests and embedders can have several)."""

    def __init__(self, limits: Limits, sources: Sources,
                 loaded: Callable[[], common_pb2.ModelInfo | None] = lambda: None) -> None:
        """``loaded``: the model requests run on, whose defaults give the steps of a request that sets none."""
        self.limits = limits
        self.loaded = loaded
        self.sources = sources
        self.stats = Statistics()
        self.idle_sleeps = 0
        self.active = 0
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("diffusion_requests", "Finished WorkerService calls by method and gRPC code",
                                ["method", "code"], registry=r)
        self.images = Counter("diffusion_images_generated", "Images generated and returned", registry=r)
        # GetStatus's statistics count images only (WorkerStatistics has no video fields).
        self.videos = Counter("diffusion_videos_generated", "Videos generated and returned", registry=r)
        self.video_frames = Counter("diffusion_video_frames_generated", "Frames of the videos generated and returned",
                                    registry=r)
        self.steps = Counter("diffusion_denoising_steps", "Denoising steps of successful generations", registry=r)
        self.adapter_requests = Counter("diffusion_adapter_requests", "Successful generations by adapter (LoRA, "
                                        "ControlNet or IP-Adapter)", ["adapter"], registry=r)
        self.queue_seconds = Histogram("diffusion_queue_seconds", "Time requests waited in the queue",
                                       buckets=SECONDS_BUCKETS, registry=r)
        self.execute_seconds = Histogram("diffusion_execute_seconds", "Time requests ran on a runner",
                                         buckets=SECONDS_BUCKETS, registry=r)
        self.phase_seconds = Histogram("diffusion_phase_seconds",
                                       "Time successful generations spent by phase: the runner's (text_encode, "
                                       "denoise, decode, to_host) and the worker's (transfer, encode)",
                                       ["phase"], buckets=SECONDS_BUCKETS, registry=r)
        self.request_seconds = Histogram("diffusion_request_seconds", "End-to-end time of successful generations",
                                         buckets=SECONDS_BUCKETS, registry=r)
        r.register(self)
        self._http: Any = None

    # -- the HTTP endpoint --------------------------------------------------------------------

    def serve_http(self, host: str, port: int) -> int:
        """Starts the scrape endpoint in a thread; returns the bound port. Raises OSError if taken."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    # -- recording ----------------------------------------------------------------------------

    def record_call(self, method: str, code: grpc.StatusCode) -> None:
        self.requests.labels(method, code.name).inc()
        self.stats.requests[(method, code.name)] += 1

    def record_generation(self, request: worker_pb2.GenerateRequest, response: worker_pb2.GenerateResponse) -> None:
        timings = response.timings
        steps = request.num_inference_steps or defaults_in_force(self.loaded(), self.limits).num_inference_steps
        self.images.inc(len(response.images))
        self.videos.inc(len(response.videos))
        self.video_frames.inc(sum(video.num_frames for video in response.videos))
        self.request_seconds.observe(timings.total_ms / 1000)
        s = self.stats
        s.images += len(response.images)
        s.generations += 1
        if answered_from_memory(response):  # nothing queued or ran
            steps = 0
        else:
            self.queue_seconds.observe(timings.queue_ms / 1000)
            self.execute_seconds.observe(timings.execute_ms / 1000)
            runner = timings.runner
            for phase, ms in (("text_encode", runner.text_encode_ms), ("denoise", runner.denoise_ms),
                              ("decode", runner.decode_ms), ("to_host", runner.to_host_ms),
                              ("transfer", timings.transfer_ms), ("encode", timings.encode_ms)):
                self.phase_seconds.labels(phase).observe(ms / 1000)
        self.steps.inc(steps)
        s.queue_ms += timings.queue_ms
        s.execute_ms += timings.execute_ms
        s.steps += steps
        named = [*(adapter.name for adapter in request.adapters), *(control.name for control in request.controls),
                 *((request.ip_adapter.name,) if request.HasField("ip_adapter") else ())]
        for name in dict.fromkeys(named):  # a ControlNet given twice counts one request
            self.adapter_requests.labels(name).inc()
            s.adapter_requests[name] += 1

    def statistics(self) -> worker_pb2.WorkerStatistics:
        s = self.stats
        n = max(s.generations, 1)
        return worker_pb2.WorkerStatistics(
            requests=[worker_pb2.RequestCount(method=m, code=c, count=count)
                      for (m, c), count in sorted(s.requests.items())],
            images_generated=s.images, generations=s.generations,
            queue_ms_total=s.queue_ms, queue_ms_mean=s.queue_ms / n,
            execute_ms_total=s.execute_ms, execute_ms_mean=s.execute_ms / n,
            denoising_steps=s.steps, idle_sleeps=self.idle_sleeps,
        )

    # -- scrape-time gauges (prometheus_client Collector) -------------------------------------

    def count_idle_sleep(self) -> None:
        self.idle_sleeps += 1

    def collect(self) -> Iterable[Any]:
        src = self.sources
        yield GaugeMetricFamily("diffusion_queue_depth", "Requests waiting in the queue", value=src.queue_depth())
        yield GaugeMetricFamily("diffusion_requests_in_flight", "Requests running on a runner now",
                                value=src.in_flight())
        yield GaugeMetricFamily("diffusion_requests_active", "Generate calls being handled (queued, running, "
                                "encoding)", value=self.active)
        yield GaugeMetricFamily("diffusion_requests_receiving", "Generate calls receiving their request message",
                                value=src.receiving())
        yield GaugeMetricFamily("diffusion_requests_waiting_to_receive", "Generate calls waiting for a receive slot "
                                "(--max-receiving-requests)", value=src.waiting_to_receive())
        yield GaugeMetricFamily("diffusion_sleep_level", "Sleep level of the model; 0 when awake",
                                value=src.sleep_level())
        state = GaugeMetricFamily("diffusion_worker_state", "1 for the worker's current lifecycle state",
                                  labels=["state"])
        current = src.state()
        for name, number in worker_pb2.WorkerState.items():
            if number:
                state.add_metric([name.removeprefix("WORKER_STATE_")], 1.0 if number == current else 0.0)
        yield state
        idle = CounterMetricFamily("diffusion_idle_sleeps", "Times the idle timer put the model to sleep")
        idle.add_metric([], self.idle_sleeps)
        yield idle
        results = src.result_cache()
        yield CounterMetricFamily("diffusion_result_cache_hits", "Seeded requests answered from the result cache",
                                  value=results.hits)
        yield CounterMetricFamily("diffusion_result_cache_misses",
                                  "Seeded requests the result cache did not hold (while it is on)",
                                  value=results.misses)
        yield GaugeMetricFamily("diffusion_result_cache_entries", "Responses in the result cache",
                                value=results.entries)
        yield GaugeMetricFamily("diffusion_result_cache_bytes", "Bytes of the responses in the result cache",
                                value=results.bytes)
        up = GaugeMetricFamily("diffusion_runner_up", "1 when the runner is reachable", labels=["target"])
        restarts = CounterMetricFamily("diffusion_runner_restarts", "Runner restarts seen (new instance id)",
                                       labels=["target"])
        used = GaugeMetricFamily("diffusion_runner_memory_used_bytes", "Device memory in use on the runner",
                                 labels=["target"])
        total = GaugeMetricFamily("diffusion_runner_memory_total_bytes", "Device memory of the runner",
                                  labels=["target"])
        resident = GaugeMetricFamily("diffusion_runner_adapters_resident", "LoRA adapters on the runner's device",
                                     labels=["target"])
        cache_hits = CounterMetricFamily("diffusion_runner_prompt_cache_hits",
                                         "Prompts the runner found encoded in its cache", labels=["target"])
        cache_misses = CounterMetricFamily("diffusion_runner_prompt_cache_misses",
                                           "Prompts the runner encoded (not in its cache)", labels=["target"])
        cache_bytes = GaugeMetricFamily("diffusion_runner_prompt_cache_bytes",
                                        "Bytes of encoded prompts the runner keeps", labels=["target"])
        step_rows = CounterMetricFamily("diffusion_runner_cache_rows",
                                        "Denoiser rows (an image's branch at a step) run with the step cache",
                                        labels=["target"])
        step_skipped = CounterMetricFamily("diffusion_runner_cache_skipped",
                                           "Denoiser rows whose blocks after the first the step cache skipped",
                                           labels=["target"])
        for runner in list(src.runners()):
            memory = runner.info.memory if runner.info is not None else None
            if runner.info is not None and runner.info.HasField("cache"):
                step_rows.add_metric([runner.target], runner.info.cache.rows)
                step_skipped.add_metric([runner.target], runner.info.cache.skipped_rows)
            cache = runner.info.prompt_cache if runner.info is not None else None
            cache_hits.add_metric([runner.target], cache.hits if cache else 0)
            cache_misses.add_metric([runner.target], cache.misses if cache else 0)
            cache_bytes.add_metric([runner.target], cache.bytes if cache else 0)
            up.add_metric([runner.target], 1.0 if runner.connected else 0.0)
            restarts.add_metric([runner.target], runner.restarts)
            used.add_metric([runner.target], memory.used_bytes if memory else 0)
            total.add_metric([runner.target], memory.total_bytes if memory else 0)
            resident.add_metric([runner.target], sum(a.resident for a in runner.info.adapters) if runner.info else 0)
        yield from (up, restarts, used, total, resident, cache_hits, cache_misses, cache_bytes, step_rows,
                    step_skipped)


def _code_of(context: Context, error: BaseException | None) -> grpc.StatusCode:
    if error is None:
        return context.code() or grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    return code if code is not None and code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN


# The servicer's behaviour a handler wraps: a coroutine function, or an async generator function.
Handler = Callable[[Any, Context], Any]

# grpc's handler factories by (request streaming, response streaming).
_FACTORIES: dict[tuple[bool, bool], Callable[..., MethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _behavior(handler: MethodHandler) -> Handler:
    """What ``handler`` runs: the one of its four behaviours that is set."""
    behavior: Any = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    return cast(Handler, behavior)


class _Remembering:
    """A request stream that keeps the last message read: a gated Generate's one request
    (``worker_service.receive_gate``), for its generation's metrics."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests
        self.last: Any = None

    def __aiter__(self) -> _Remembering:
        return self

    async def __anext__(self) -> Any:
        self.last = await anext(self._requests)
        return self.last


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Counts every WorkerService call by outcome, records generations and tells ``on_activity``
    of calls (the idle timer). It only observes. Put it first, so refusals count."""

    def __init__(self, metrics: WorkerMetrics, on_activity: Callable[[str, bool], None]) -> None:
        self.metrics = metrics
        self.on_activity = on_activity

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> MethodHandler | None:
        handler = await continuation(details)
        full_method: str = details.method
        if handler is None or not full_method.startswith(SERVICE_PREFIX):
            return handler
        method = full_method[len(SERVICE_PREFIX):]
        observe = self._stream if handler.response_streaming else self._unary
        observed = observe(method, _behavior(handler), handler.request_streaming and method in GENERATE_METHODS)
        return _FACTORIES[handler.request_streaming, handler.response_streaming](
            observed, handler.request_deserializer, handler.response_serializer)

    def _begin(self, method: str) -> None:
        if method in GENERATE_METHODS:
            self.metrics.active += 1
        self.on_activity(method, False)

    def _end(self, method: str, context: Context, error: BaseException | None) -> None:
        if method in GENERATE_METHODS:
            self.metrics.active -= 1
        code = _code_of(context, error)
        self.metrics.record_call(method, code)
        self.on_activity(method, code == grpc.StatusCode.OK)

    def _unary(self, method: str, behavior: Handler, remember: bool) -> Handler:
        async def observed(request: Any, context: Context) -> Any:
            self._begin(method)
            error: BaseException | None = None
            received = _Remembering(request) if remember else request
            try:
                response = await behavior(received, context)
                if method == "Generate" and isinstance(response, worker_pb2.GenerateResponse):
                    self.metrics.record_generation(received.last if remember else request, response)
                return response
            except BaseException as caught:
                error = caught
                raise
            finally:
                self._end(method, context, error)

        return observed

    def _stream(self, method: str, behavior: Handler, remember: bool) -> Handler:
        async def observed(request: Any, context: Context) -> AsyncIterator[Any]:
            self._begin(method)
            error: BaseException | None = None
            received = _Remembering(request) if remember else request
            try:
                produced = behavior(received, context)
                if not hasattr(produced, "__aiter__"):  # a handler that only aborts (authentication)
                    await produced
                    return
                async for response in produced:
                    if (method == "GenerateStream" and isinstance(response, worker_pb2.GenerateStreamResponse)
                            and response.HasField("done")):
                        message = received.last if remember else request
                        self.metrics.record_generation(message.request, response.done)
                    yield response
            except BaseException as caught:
                error = caught
                raise
            finally:
                self._end(method, context, error)

        return observed
