"""``diffusion-worker``: flags (each also from ``DIFFUSION_WORKER_<FLAG>``), wiring, serving, draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Sequence

import grpc

from clients.logging_setup import configure_logging
from clients.rpc import EnvDefaultsParser, create_server, install_shutdown_signals
from diffusion.v1 import common_pb2, worker_pb2_grpc

from .config import Limits, WorkerConfig
from .controller import ModelController
from .errors import RpcFailure
from .lifecycle import WORKER_SERVICE, Lifecycle
from .ops import Operations, check_config
from .runner_client import RunnerClient
from .scheduler import Scheduler
from .service import WorkerServicer

logger = logging.getLogger("worker_service")

# Seconds that control RPCs still running get once generation has drained.
STOP_GRACE_S = 2.0

DTYPES = {
    "auto": common_pb2.DTYPE_UNSPECIFIED,
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
}


def parse_args(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, str, bool]:
    """The worker's configuration, the log level and whether logs are JSON."""
    defaults, limits = WorkerConfig(), Limits()
    parser = EnvDefaultsParser(prog="diffusion-worker", description=__doc__, env_prefix="DIFFUSION_WORKER_")
    parser.add_argument("--listen", default=defaults.listen, help="host:port or unix:/path to serve on")
    parser.add_argument("--runner", action="append", help=f"runner target, host:port or unix:/path "
                        f"(default {defaults.runners[0]}); repeat for several runners, one per accelerator")
    parser.add_argument("--model", default=defaults.model, help="model to Init at start; empty: none")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="dtype of the model weights")
    parser.add_argument("--auto-wake", action="store_true", help="wake a sleeping model on Generate")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue, help="requests waiting at most")
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="images per runner Execute when compatible requests are queued; 1: no batching")
    parser.add_argument("--max-batch-delay-ms", type=float, default=defaults.max_batch_delay_ms,
                        help="milliseconds the head of the queue waits for a batch to fill")
    parser.add_argument("--max-runner-wait", type=float, default=defaults.max_runner_wait,
                        help="seconds queued requests wait for a ready runner (while one restarts) "
                        "before UNAVAILABLE")
    parser.add_argument("--min-size", type=int, default=limits.min_size, help="smallest width/height")
    parser.add_argument("--max-size", type=int, default=limits.max_size, help="largest width/height")
    parser.add_argument("--max-steps", type=int, default=limits.max_steps, help="most denoising steps")
    parser.add_argument("--max-images", type=int, default=limits.max_images, help="most images per request")
    parser.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars,
                        help="longest prompt and negative prompt")
    parser.add_argument("--grace", type=float, default=defaults.grace,
                        help="seconds for queued and running requests to finish after SIGTERM")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    add_operations_flags(parser, defaults)
    args = parser.parse_args(argv)
    runners = tuple(args.runner or defaults.runners)
    if len(set(runners)) != len(runners):
        parser.error("each --runner must be a different target")
    if args.max_batch_size < 1 or args.max_batch_delay_ms < 0:
        parser.error("--max-batch-size must be >= 1 and --max-batch-delay-ms >= 0")
    if args.max_queue < 1 or not 8 <= args.min_size <= args.max_size:
        parser.error("--max-queue must be >= 1 and 8 <= --min-size <= --max-size")
    config = WorkerConfig(
        listen=args.listen, runners=runners, model=args.model, dtype=DTYPES[args.dtype],
        auto_wake=args.auto_wake, max_queue=args.max_queue, grace=args.grace,
        max_batch_size=args.max_batch_size, max_batch_delay_ms=args.max_batch_delay_ms,
        max_runner_wait=args.max_runner_wait,
        limits=Limits(min_size=args.min_size, max_size=args.max_size, max_steps=args.max_steps,
                      max_images=args.max_images, max_prompt_chars=args.max_prompt_chars),
        **operations_settings(args),
    )
    try:
        check_config(config)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    return config, args.log_level, args.log_json


def add_operations_flags(parser: EnvDefaultsParser, defaults: WorkerConfig) -> None:
    """Metrics, tokens, TLS, message size and idle sleep (README "Operations")."""
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                        help="Prometheus metrics over HTTP on the host of --listen (0.0.0.0 for a unix "
                        "socket); 0: off")
    parser.add_argument("--ops-token-file", default="", help="token Init, Sleep, WakeUp, LoadWeights, "
                        "Attach/DetachRunner and Cancel need (authorization: Bearer); none: open")
    parser.add_argument("--inference-token-file", default="",
                        help="token Generate, GenerateStream, GetStatus and Cancel need; none: open")
    parser.add_argument("--runner-token-file", default="", help="token sent to the runners (their "
                        "--auth-token-file)")
    parser.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default="", help="PEM CA bundle: require client certificates "
                        "signed by it (mutual TLS)")
    parser.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes,
                        help="largest gRPC message sent or received; must hold --max-images raw "
                        "--max-size images")
    parser.add_argument("--sleep-after-idle", type=float, default=defaults.sleep_after_idle,
                        help="seconds without requests before the model is put to sleep; 0: never")
    parser.add_argument("--idle-sleep-level", type=int, default=defaults.idle_sleep_level, choices=[1, 2],
                        help="sleep level of the idle sleep")


def operations_settings(args) -> dict:
    names = ("metrics_port", "ops_token_file", "inference_token_file", "runner_token_file", "tls_cert",
             "tls_key", "tls_client_ca", "max_message_bytes", "sleep_after_idle", "idle_sleep_level")
    return {name: getattr(args, name) for name in names}


async def serve(config: WorkerConfig) -> None:
    """Serves until SIGTERM/SIGINT, then drains within ``config.grace``; a second signal cuts it short."""
    started = time.monotonic()
    ops = Operations(config)
    server, health_servicer = create_server(config.listen, [WORKER_SERVICE], **ops.server_options())
    runners = [RunnerClient(target) for target in config.runners]
    lifecycle = Lifecycle(health_servicer, ", ".join(config.runners))
    controller = ModelController(runners, lifecycle, config.model, config.dtype)
    scheduler = Scheduler(controller, lifecycle, config.max_queue, config.auto_wake,
                          config.max_batch_size, config.max_batch_delay_ms, config.max_runner_wait)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(config.limits, lifecycle, controller, scheduler), server)
    await server.start()
    await lifecycle.update()
    tasks = [asyncio.create_task(scheduler.run(), name="dispatcher")]
    controller.start()  # one health Watch per runner; AttachRunner/DetachRunner change ``runners``
    tasks += ops.start(scheduler, lifecycle, controller, lambda: controller.runners)
    logger.info("worker serving on %s (runner %s, model %r) after %.2f s", config.listen,
                ", ".join(config.runners), config.model, time.monotonic() - started)

    signals: asyncio.Queue[int] = asyncio.Queue()
    install_shutdown_signals(asyncio.get_running_loop(), signals.put_nowait)
    signum = await signals.get()
    logger.info("%s: draining (up to %.0f s)", signal.Signals(signum).name, config.grace)
    await lifecycle.update(draining=True)
    idle = asyncio.create_task(scheduler.wait_idle())
    second = asyncio.create_task(signals.get())
    await asyncio.wait([idle, second], timeout=config.grace, return_when=asyncio.FIRST_COMPLETED)
    if not idle.done():
        logger.warning("stopping with requests unfinished")
        scheduler.cancel_all(RpcFailure(grpc.StatusCode.UNAVAILABLE, "worker shut down before the request finished"))
    second.cancel()
    idle.cancel()
    # Generation is done; what remains are control RPCs and health Watch streams, which never end.
    await server.stop(STOP_GRACE_S)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for runner in list(runners):
        await runner.close()
    ops.close()
    logger.info("worker stopped")


def main(argv: Sequence[str] | None = None) -> int:
    config, log_level, log_json = parse_args(argv)
    configure_logging(log_level, log_json)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
