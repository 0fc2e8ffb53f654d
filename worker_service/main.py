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

from clients.rpc import EnvDefaultsParser, create_server, install_shutdown_signals
from diffusion.v1 import common_pb2, worker_pb2_grpc

from .config import Limits, WorkerConfig
from .controller import ModelController
from .errors import RpcFailure
from .lifecycle import WORKER_SERVICE, Lifecycle
from .logs import configure_logging
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
                        f"(default {defaults.runners[0]}; one for now)")
    parser.add_argument("--model", default=defaults.model, help="model to Init at start; empty: none")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="dtype of the model weights")
    parser.add_argument("--auto-wake", action="store_true", help="wake a sleeping model on Generate")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue, help="requests waiting at most")
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
    args = parser.parse_args(argv)
    runners = tuple(args.runner or defaults.runners)
    if len(runners) != 1:
        parser.error("exactly one --runner is supported for now")
    if args.max_queue < 1 or not 8 <= args.min_size <= args.max_size:
        parser.error("--max-queue must be >= 1 and 8 <= --min-size <= --max-size")
    config = WorkerConfig(
        listen=args.listen, runners=runners, model=args.model, dtype=DTYPES[args.dtype],
        auto_wake=args.auto_wake, max_queue=args.max_queue, grace=args.grace,
        limits=Limits(min_size=args.min_size, max_size=args.max_size, max_steps=args.max_steps,
                      max_images=args.max_images, max_prompt_chars=args.max_prompt_chars),
    )
    return config, args.log_level, args.log_json


async def serve(config: WorkerConfig) -> None:
    """Serves until SIGTERM/SIGINT, then drains within ``config.grace``; a second signal cuts it short."""
    started = time.monotonic()
    server, health_servicer = create_server(config.listen, [WORKER_SERVICE])
    runners = [RunnerClient(target) for target in config.runners]
    lifecycle = Lifecycle(health_servicer, runners[0].target)
    controller = ModelController(runners[0], lifecycle, config.model, config.dtype)
    scheduler = Scheduler(controller, lifecycle, config.max_queue, config.auto_wake)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(config.limits, lifecycle, controller, scheduler, runners), server)
    await server.start()
    await lifecycle.update()
    tasks = [asyncio.create_task(scheduler.run(), name="dispatcher"),
             *(asyncio.create_task(r.watch(controller.on_runner_change), name=f"watch {r.target}")
               for r in runners)]
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
    for runner in runners:
        await runner.close()
    logger.info("worker stopped")


def main(argv: Sequence[str] | None = None) -> int:
    config, log_level, log_json = parse_args(argv)
    configure_logging(log_level, log_json)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
