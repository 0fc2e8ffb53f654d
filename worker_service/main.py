"""diffusion-worker: the front of a diffusion serving pod. It admits, queues and batches image requests
for its runners and owns the model's lifecycle (each flag also from DIFFUSION_WORKER_<FLAG>).

Here are its flags; worker_service.app wires and serves.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from diffusion.v1 import common_pb2
from serving_common.auth import read_token
from serving_common.flags import EnvDefaultsParser
from serving_common.logs import configure_logging
from serving_common.protocol import DTYPES
from serving_common.server import ListenError
from serving_common.supervision import die_with_parent
from worker_service.app import serve
from worker_service.config import HttpLimits, Limits, WorkerConfig
from worker_service.http.body import MAX_BODY_BYTES
from worker_service.scheduling.batching import DEADLINE_AGING_S
from worker_service.security import ConfigError, check_message_limit, server_credentials

AUTO_DTYPE = "auto"


def parse_args(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, str, bool]:
    """The worker's configuration, the log level and whether logs are JSON."""
    defaults, limits = WorkerConfig(), Limits()
    parser = EnvDefaultsParser(prog="diffusion-worker", description=__doc__.split("\n\n")[0],
                               env_prefix="DIFFUSION_WORKER_")
    parser.add_argument("--listen", default=defaults.listen, help="host:port or unix:/path to serve on")
    parser.add_argument("--runner", action="append", help=f"runner target, host:port or unix:/path "
                        f"(default {defaults.runners[0]}); repeat for several runners, one per accelerator")
    parser.add_argument("--model", default=defaults.model, help="model to Init at start; empty: none")
    parser.add_argument("--dtype", default="auto", choices=[AUTO_DTYPE, *sorted(DTYPES)],
                        help="dtype of the model weights; auto: the runner's platform default")
    parser.add_argument("--auto-wake", action="store_true", help="wake a sleeping model on Generate")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue, help="requests waiting at most")
    parser.add_argument("--max-input-bytes", type=int, default=defaults.max_input_bytes,
                        help="bytes of image inputs (image and mask, as sent) that requests in progress hold in "
                        "all; a request past it is refused RESOURCE_EXHAUSTED before anything is decoded")
    parser.add_argument("--max-receiving-requests", type=int, default=defaults.max_receiving_requests,
                        help="Generate and GenerateStream calls receiving their request at once; the others wait "
                        "(until their deadline) with their bytes still at the client")
    parser.add_argument("--receive-timeout", type=float, default=defaults.receive_timeout,
                        help="seconds a Generate request may take to arrive once it may be received; a slower "
                        "one is refused DEADLINE_EXCEEDED")
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="images per runner Execute when compatible requests are queued; 1: no batching")
    parser.add_argument("--max-batch-delay-ms", type=float, default=defaults.max_batch_delay_ms,
                        help="milliseconds the head of the queue waits for a batch to fill")
    parser.add_argument("--schedule", choices=["fifo", "deadline"], default=defaults.schedule,
                        help="which queued request runs next: the oldest, or the one whose deadline comes first "
                        f"(a request without one counts as due {DEADLINE_AGING_S:g} s after it arrived)")
    parser.add_argument("--max-runner-wait", type=float, default=defaults.max_runner_wait,
                        help="seconds queued requests wait for a ready runner (while one restarts) "
                        "before UNAVAILABLE")
    parser.add_argument("--runner-keepalive", type=float, default=defaults.runner_keepalive,
                        help="seconds between HTTP/2 keepalive pings to each runner; a runner that does not "
                        "answer one within 5 s is unreachable (0: off)")
    parser.add_argument("--runner-stall-timeout", type=float, default=defaults.runner_stall_timeout,
                        help="seconds an Execute may go without progress (or ten times its last step time, when "
                        "longer) before its runner is treated as hung and the batch is retried")
    parser.add_argument("--runner-poll-interval", type=float, default=defaults.runner_poll_interval,
                        help="seconds between GetInfo polls of each runner: memory for the metrics, and "
                        "state changed behind the worker's back (which it then re-applies)")
    parser.add_argument("--state-file", default=defaults.state_file,
                        help="JSON file keeping the desired state (model, weight updates, sleep) across worker "
                        "restarts; empty: not kept")
    parser.add_argument("--push-dir", default=defaults.push_dir,
                        help="where PushWeights content is kept for runners that restart; empty: beside "
                        "--state-file, or a temporary directory")
    parser.add_argument("--max-pushed-bytes", type=int, default=defaults.max_pushed_bytes,
                        help="PushWeights content kept in all; a push past it is refused")
    parser.add_argument("--min-size", type=int, default=limits.min_size, help="smallest width/height")
    parser.add_argument("--max-size", type=int, default=limits.max_size, help="largest width/height")
    parser.add_argument("--max-steps", type=int, default=limits.max_steps, help="most denoising steps")
    parser.add_argument("--max-images", type=int, default=limits.max_images, help="most images per request")
    parser.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars,
                        help="longest prompt and negative prompt")
    parser.add_argument("--max-guidance", type=float, default=limits.max_guidance, help="largest guidance_scale")
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
    if args.runner_poll_interval <= 0 or args.runner_stall_timeout <= 0 or args.runner_keepalive < 0:
        parser.error("--runner-poll-interval and --runner-stall-timeout must be > 0, --runner-keepalive >= 0")
    if args.max_queue < 1 or not 8 <= args.min_size <= args.max_size:
        parser.error("--max-queue must be >= 1 and 8 <= --min-size <= --max-size")
    if args.max_pushed_bytes < 0 or args.max_input_bytes < 0:
        parser.error("--max-pushed-bytes and --max-input-bytes must be >= 0")
    if args.max_receiving_requests < 1 or not args.receive_timeout > 0:
        parser.error("--max-receiving-requests must be >= 1 and --receive-timeout > 0")
    config = WorkerConfig(
        listen=args.listen, runners=runners, model=args.model,
        dtype=common_pb2.DTYPE_UNSPECIFIED if args.dtype == AUTO_DTYPE else DTYPES[args.dtype],
        auto_wake=args.auto_wake, max_queue=args.max_queue, max_input_bytes=args.max_input_bytes, grace=args.grace,
        max_receiving_requests=args.max_receiving_requests, receive_timeout=args.receive_timeout,
        max_batch_size=args.max_batch_size, max_batch_delay_ms=args.max_batch_delay_ms, schedule=args.schedule,
        max_runner_wait=args.max_runner_wait, runner_keepalive=args.runner_keepalive,
        runner_stall_timeout=args.runner_stall_timeout, runner_poll_interval=args.runner_poll_interval,
        state_file=args.state_file, push_dir=args.push_dir, max_pushed_bytes=args.max_pushed_bytes,
        limits=Limits(min_size=args.min_size, max_size=args.max_size, max_steps=args.max_steps,
                      max_images=args.max_images, max_prompt_chars=args.max_prompt_chars,
                      max_guidance=args.max_guidance),
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
    parser.add_argument("--http-port", type=int, default=defaults.http_port,
                        help="OpenAI Images API (POST /v1/images/generations, GET /v1/models) over HTTP on "
                        "the host of --listen, HTTPS with --tls-cert; 0: off")
    http = defaults.http_limits
    parser.add_argument("--http-max-connections", type=int, default=http.max_connections,
                        help="HTTP connections open at once; one more is answered 503 and closed")
    parser.add_argument("--http-header-timeout", type=float, default=http.header_timeout,
                        help="seconds an HTTP connection has to send a request's headers (from its start, or the "
                        "previous response) before it is closed")
    parser.add_argument("--http-body-timeout", type=float, default=http.body_timeout,
                        help="seconds an HTTP request has to send its whole body after its headers before its "
                        "connection is closed")
    parser.add_argument("--http-max-body-bytes-in-flight", type=int, default=http.max_body_bytes_in_flight,
                        help="bytes of HTTP request bodies being received at once, over all connections; a body "
                        f"past it is refused 429 (at least {MAX_BODY_BYTES}, the largest body)")
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


def check_config(config: WorkerConfig) -> None:
    """Raises ConfigError (or OSError) for flags the worker must not start with: unreadable token or
    certificate files, a message limit below the largest response, bad idle or metrics settings."""
    check_message_limit(config.max_message_bytes, config.limits)
    for path in (config.ops_token_file, config.inference_token_file, config.runner_token_file):
        read_token(path)
    server_credentials(config)
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError("--metrics-port must be 0 (off) to 65535")
    if not 0 <= config.http_port <= 65535:
        raise ConfigError("--http-port must be 0 (off) to 65535")
    http = config.http_limits
    if http.max_connections < 1 or not (http.header_timeout > 0 and http.body_timeout > 0):
        raise ConfigError("--http-max-connections must be >= 1, --http-header-timeout and --http-body-timeout > 0")
    if http.max_body_bytes_in_flight < MAX_BODY_BYTES:
        raise ConfigError(f"--http-max-body-bytes-in-flight must be at least {MAX_BODY_BYTES}, the largest body")
    if config.sleep_after_idle < 0 or config.idle_sleep_level not in (1, 2):
        raise ConfigError("--sleep-after-idle must be >= 0 and --idle-sleep-level 1 or 2")


def operations_settings(args: argparse.Namespace) -> dict[str, Any]:
    names = ("metrics_port", "http_port", "ops_token_file", "inference_token_file", "runner_token_file", "tls_cert",
             "tls_key", "tls_client_ca", "max_message_bytes", "sleep_after_idle", "idle_sleep_level")
    http = HttpLimits(max_connections=args.http_max_connections, header_timeout=args.http_header_timeout,
                      body_timeout=args.http_body_timeout, max_body_bytes_in_flight=args.http_max_body_bytes_in_flight)
    return {**{name: getattr(args, name) for name in names}, "http_limits": http}


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # started by deploy/pod.py: end with it
    config, log_level, log_json = parse_args(argv)
    configure_logging(log_level, log_json)
    try:
        asyncio.run(serve(config))
    except ListenError as error:
        raise SystemExit(f"diffusion-worker: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
