"""The worker wired in one place: every part built with what it needs, served, then drained.

Build order follows the dependencies: health, the gate and the runner pool first, then the
lifecycle (which reads the runners and the controller's desired state), the controller, the queue
and the dispatcher; metrics, the idle timer and the status reporter read
from those; the interceptors observe and authenticate; the servicer sits on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health
from starlette.applications import Starlette

from diffusion.v1 import runner_pb2
from serving_common.auth import read_token, token_interceptors
from serving_common.channels import keepalive_options
from serving_common.errors import ServiceError
from serving_common.logs import request_id_interceptors
from serving_common.protocol import WORKER_SERVICE
from serving_common.server import create_server, install_shutdown_signals
from worker_service.config import WorkerConfig
from worker_service.controller import ModelController
from worker_service.http.body import BodyBudget
from worker_service.http.image_store import ImageStore
from worker_service.http.image_urls import ImageUrls
from worker_service.http.openai_images import ImagesApi, create_app
from worker_service.http.openai_videos import VideosApi
from worker_service.http.openai_videos import routes as video_routes
from worker_service.http.server import HttpServer
from worker_service.idle import IdleSleeper
from worker_service.image_inputs import configure_pillow
from worker_service.lifecycle import Lifecycle
from worker_service.metrics import ObservingInterceptor, Sources, WorkerMetrics, metrics_host
from worker_service.receive_gate import RECEIVE_WINDOW_OPTIONS, ReceiveGate, add_worker_service
from worker_service.result_cache import ResultCache, served_identity
from worker_service.runners import ChannelSettings, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import RECONNECT_OPTIONS
from worker_service.scheduling.admission import AdmissionQueue
from worker_service.scheduling.batching import BatchPolicy
from worker_service.scheduling.dispatcher import Dispatcher
from worker_service.security import auth_interceptors, server_credentials, worker_token_policy
from worker_service.served_names import ServedNames
from worker_service.service import WorkerServicer
from worker_service.state_store import StateStore
from worker_service.status import StatusReporter
from worker_service.video_jobs import VideoJobStore
from worker_service.weight_push import PushStore

logger = logging.getLogger("worker_service")

# Seconds that control RPCs still running get once generation has drained.
STOP_GRACE_S = 2.0
# Seconds each step of stopping, after the drain, may take before the worker goes on without it.
CLEANUP_STEP_S = 10.0


def execute_request_ids(request: object) -> str:
    """The request ids of a runner ExecuteRequest, comma-separated (x-request-id of the call)."""
    if not isinstance(request, runner_pb2.ExecuteRequest):
        return ""
    return ",".join(item.request_id for item in request.items if item.request_id)


def runner_channel_settings(config: WorkerConfig) -> ChannelSettings:
    """Runner channels send the runner token and the request ids of every Execute."""
    interceptors = [*token_interceptors(read_token(config.runner_token_file)),
                    *request_id_interceptors(execute_request_ids)]
    return ChannelSettings(interceptors=tuple(interceptors), max_message_bytes=config.max_message_bytes,
                           options=(*RECONNECT_OPTIONS, *keepalive_options(config.runner_keepalive)))


@dataclass
class Worker:
    """Every long-lived part of one worker."""

    config: WorkerConfig
    health: health.aio.HealthServicer
    lifecycle: Lifecycle
    pool: RunnerPool
    controller: ModelController
    queue: AdmissionQueue
    dispatcher: Dispatcher
    metrics: WorkerMetrics
    idle: IdleSleeper
    server: grpc.aio.Server
    images_api: Starlette  # the OpenAI Images API, served on --http-port
    pushes: PushStore


def build(config: WorkerConfig) -> Worker:
    """Builds the worker; binds its gRPC port (OSError when it cannot) but starts nothing."""
    configure_pillow(config.limits.max_size)
    health_servicer = health.aio.HealthServicer()
    wakeup = asyncio.Event()
    gate = ExecutionGate(on_open=wakeup.set)
    pool = RunnerPool(config.runners, runner_channel_settings(config), gate, config.runner_poll_interval)
    pushes = PushStore(config.push_dir or (f"{config.state_file}.pushes" if config.state_file else ""),
                       config.max_pushed_bytes)
    controller: ModelController  # the lifecycle reads its desired state when asked
    lifecycle = Lifecycle(health_servicer, pool, desired=lambda: controller.desired)
    results = ResultCache(config.result_cache.result_cache_bytes, config.result_cache.result_cache_entries,
                          identity=lambda: served_identity(lifecycle.model, lifecycle.weights_version,
                                                           ((a.name, a.digest) for a in controller.desired.adapters)
                                                           if controller.desired is not None else ()))
    controller = ModelController(pool, gate, lifecycle, config.model, config.dtype, wakeup,
                                 StateStore(config.state_file), pushes, config.acceleration.to_proto(),
                                 config.parallel.to_proto(), overrides=config.component_overrides(),
                                 fused=config.fused_adapters(), on_outputs_change=results.clear)
    queue = AdmissionQueue(lifecycle, config.max_queue, config.auto_wake, wakeup, config.max_input_bytes)
    dispatcher = Dispatcher(queue, pool, gate, controller, lifecycle, wakeup,
                            BatchPolicy(config.max_batch_size, config.max_batch_delay_ms / 1000,
                                        config.max_message_bytes // 2, config.schedule == "deadline"),
                            config.max_runner_wait, config.runner_stall_timeout)
    receive_gate = ReceiveGate(config.max_receiving_requests, config.receive_timeout)
    metrics = WorkerMetrics(config.limits, Sources(
        queue_depth=lambda: len(queue), in_flight=lambda: dispatcher.in_flight,
        state=lambda: lifecycle.state, sleep_level=lambda: lifecycle.sleep_level, runners=lambda: pool.runners,
        receiving=lambda: receive_gate.receiving, waiting_to_receive=lambda: receive_gate.waiting,
        result_cache=results.stats),
        loaded=lambda: lifecycle.model)
    idle = IdleSleeper(config.sleep_after_idle, config.idle_sleep_level, controller, lifecycle,
                       busy=lambda: bool(len(queue) or dispatcher.in_flight or queue.active),
                       on_sleep=metrics.count_idle_sleep)
    policy = worker_token_policy(config)  # one policy for gRPC and HTTP
    interceptors = [ObservingInterceptor(metrics, idle.on_call), *auth_interceptors(policy)]  # observing first
    server, _ = create_server(config.listen, [WORKER_SERVICE], max_message_bytes=config.max_message_bytes,
                              interceptors=interceptors, credentials=server_credentials(config),
                              health_servicer=health_servicer, options=RECEIVE_WINDOW_OPTIONS)
    served = ServedNames(config.model, config.served_model_names)
    status = StatusReporter(lifecycle, pool, queue, dispatcher, metrics, idle, controller, served, config.limits)
    servicer = WorkerServicer(config.limits, lifecycle, controller, pool, queue, status, config.max_message_bytes,
                              config.stream_chunk_bytes, image_parameters=not config.no_image_parameters,
                              results=results)
    add_worker_service(servicer, receive_gate, server)
    bodies = BodyBudget(config.http_limits.max_body_bytes_in_flight)  # one budget for both APIs' bodies
    video_jobs = VideoJobStore(config.video_jobs.max_video_jobs, config.video_jobs.max_video_bytes,
                               config.video_jobs.video_job_ttl_s)
    image_urls = ImageUrls(ImageStore(config.image_urls.max_image_urls, config.image_urls.max_image_url_bytes,
                                      config.image_urls.image_url_ttl_s), policy, metrics)
    images_api = create_app(ImagesApi(servicer.generate, lifecycle, metrics, policy, idle.on_call, int(time.time()),
                                      bodies, image_urls.keep, served),
                            [*video_routes(VideosApi(servicer.generate, lifecycle, metrics, policy, idle.on_call,
                                                     bodies, video_jobs, config.limits,
                                                     lambda: queue.leave(queue.admit(0)), served)),
                             *image_urls.routes()])
    return Worker(config, health_servicer, lifecycle, pool, controller, queue, dispatcher, metrics, idle, server,
                  images_api, pushes)


async def serve(config: WorkerConfig) -> None:
    """Serves until SIGTERM/SIGINT, then drains within ``config.grace``; a second signal cuts it short."""
    started = time.monotonic()
    worker = build(config)
    if config.metrics_port:  # bound before serving, so a taken port stops the worker at once
        host = metrics_host(config.listen)
        try:
            port = worker.metrics.serve_http(host, config.metrics_port)
        except OSError as error:
            raise SystemExit(f"diffusion-worker: cannot serve metrics on {host}:{config.metrics_port}: "
                             f"{error.strerror or error} (--metrics-port 0 turns metrics off)") from None
        logger.info("metrics on http://%s:%d/metrics", host, port)
    http = None
    if config.http_port:  # bound here too, served in this event loop once gRPC serves
        host = metrics_host(config.listen)
        try:
            http = HttpServer(worker.images_api, host, config.http_port, config)
        except OSError as error:
            raise SystemExit(f"diffusion-worker: cannot serve the OpenAI API on {host}:{config.http_port}: "
                             f"{error.strerror or error} (--http-port 0 turns it off)") from None
    await worker.server.start()
    if http is not None:
        http.start()
        logger.info("OpenAI Images API on %s://%s:%d/v1", http.scheme, host, http.port)
    await worker.lifecycle.publish()
    tasks = [asyncio.create_task(worker.dispatcher.run(), name="dispatcher"),
             asyncio.create_task(worker.idle.run(), name="idle sleep")]
    worker.controller.start()  # one health Watch per runner; AttachRunner/DetachRunner change the pool
    # What start-up made lives as long as the worker: out of the collector's sight, a collection (the
    # receive gate runs one after failed Generates) scans only what came since.
    gc.freeze()
    logger.info("worker serving on %s (runner %s, model %r) after %.2f s", config.listen,
                ", ".join(config.runners), config.model, time.monotonic() - started)

    signals: asyncio.Queue[int] = asyncio.Queue()
    install_shutdown_signals(asyncio.get_running_loop(), signals.put_nowait)
    signum = await signals.get()
    logger.info("%s: draining (up to %.0f s)", signal.Signals(signum).name, config.grace)
    await worker.lifecycle.start_draining()
    idle = asyncio.create_task(worker.queue.wait_idle())
    second = asyncio.create_task(signals.get())
    await asyncio.wait([idle, second], timeout=config.grace, return_when=asyncio.FIRST_COMPLETED)
    if not idle.done():
        logger.warning("stopping with requests unfinished")
        worker.queue.cancel_all(ServiceError(grpc.StatusCode.UNAVAILABLE,
                                             "worker shut down before the request finished"))
    second.cancel()
    idle.cancel()
    logger.info("requests done; stopping")
    finished = await stop_serving(worker, http, tasks)
    worker.pushes.close()
    worker.metrics.close()
    logger.info("worker stopped")
    if not finished:
        # A step left hanging keeps its task alive, and asyncio.run would wait for it forever.
        logging.shutdown()
        os._exit(0)


async def stop_serving(worker: Worker, http: HttpServer | None, tasks: list[asyncio.Task[None]],
                       step_timeout: float = CLEANUP_STEP_S) -> bool:
    """Stops serving once generation is done, each step within ``step_timeout`` seconds; False when
    one hung (it is logged with every task's stack, and left behind so that the worker still exits)."""

    async def stop_tasks() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        *([("the HTTP server", http.stop)] if http is not None else []),
        # What remains are control RPCs and health Watch streams, which never end by themselves.
        ("the gRPC server", lambda: worker.server.stop(STOP_GRACE_S)),
        ("the dispatcher and idle sleep", stop_tasks),
        ("the runner channels", worker.pool.close),
    ]
    finished = True
    for name, step in steps:
        running = asyncio.ensure_future(step())
        if not (await asyncio.wait({running}, timeout=step_timeout))[0]:
            finished = False
            stacks = "\n".join(_stack(task) for task in asyncio.all_tasks() if task is not asyncio.current_task())
            logger.error("stopping %s did not end within %.0f s; going on without it. Tasks:\n%s",
                         name, step_timeout, stacks)
    return finished


def _stack(task: asyncio.Task[object]) -> str:
    out = io.StringIO()
    task.print_stack(file=out)
    return out.getvalue()
