"""diffusion-runner: the model-runner sidecar, pinned to one device. It loads diffusers pipelines
and runs their denoising for a diffusion worker (each flag also from DIFFUSION_RUNNER_<FLAG>).

torch and diffusers are imported once the flags are parsed: --help and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from runner_service.libraries import quiet_libraries
from runner_service.limits import DEFAULT_MAX_ADAPTERS, DEFAULT_PROMPT_CACHE_BYTES, BatchLimits
from serving_common.auth import BearerTokenInterceptor, one_token, read_token
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES
from serving_common.flags import EnvDefaultsParser
from serving_common.logs import configure_logging
from serving_common.protocol import DTYPES, RUNNER_SERVICE
from serving_common.server import NOT_SERVING, SERVING, ListenError, create_server, install_shutdown_signals
from serving_common.supervision import die_with_parent

logger = logging.getLogger("runner_service")

MIN_MESSAGE_BYTES = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = EnvDefaultsParser(prog="diffusion-runner", description=__doc__.split("\n\n")[0],
                               env_prefix="DIFFUSION_RUNNER_")
    parser.add_argument("--listen", default="127.0.0.1:50052", help="host:port or unix:/path")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--model", default="", help="model to load at start (normally the worker asks)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="dtype for --model (default: the platform's)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--model-cache", type=Path, default=None, help="where built-in models are built")
    parser.add_argument("--spill-dir", type=Path, default=None,
                        help="CPU sleep level 1 spill files (default: a private temporary directory)")
    parser.add_argument("--model-root", type=Path, action="append", default=[],
                        help="directory LoadModel and LoadWeights may read under (repeatable; none: any)")
    parser.add_argument("--auth-token-file", default="",
                        help="file holding the token callers must send (authorization: Bearer); none: no check")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest gRPC message sent or received (an Execute result holds a whole batch "
                        "of raw images); at least 1 MiB")
    parser.add_argument("--max-weights-bytes", type=int, default=0,
                        help="most bytes one LoadWeights reads (0: twice the loaded model's parameter bytes, "
                        "at least 64 MiB)")
    parser.add_argument("--max-adapters", type=int, default=DEFAULT_MAX_ADAPTERS,
                        help="LoRA adapters resident at once; the least recently used unpinned one is evicted")
    parser.add_argument("--max-batch-images", type=int, default=BatchLimits.max_batch_images,
                        help="most images in one Execute (the worker's batches stay below)")
    parser.add_argument("--batching", choices=["step", "request"], default="step",
                        help="step: text-to-image requests of SD, SDXL and SD3 models join the running batch "
                        "at the next denoising step (other families run request by request); request: each "
                        "Execute runs as one pipeline call")
    parser.add_argument("--prompt-cache-bytes", type=int, default=DEFAULT_PROMPT_CACHE_BYTES,
                        help="encoded prompts kept for step-level batching, in bytes (0: off)")
    parser.add_argument("--max-size", type=int, default=BatchLimits.max_size, help="largest width or height")
    parser.add_argument("--max-steps", type=int, default=BatchLimits.max_steps, help="most denoising steps")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    args = parser.parse_args(argv)
    if args.dtype and args.dtype not in DTYPES:  # an environment default skips argparse's choices
        parser.error(f"--dtype must be one of {', '.join(sorted(DTYPES))}, not {args.dtype!r}")
    if min(args.max_batch_images, args.max_size, args.max_steps, args.max_adapters) < 1 \
            or min(args.max_weights_bytes, args.prompt_cache_bytes) < 0:
        parser.error("--max-batch-images, --max-size, --max-steps and --max-adapters must be at least 1, "
                     "--max-weights-bytes and --prompt-cache-bytes >= 0")
    if args.max_message_bytes < MIN_MESSAGE_BYTES:
        parser.error(f"--max-message-bytes must be at least {MIN_MESSAGE_BYTES} (1 MiB)")
    return args


async def serve(args: argparse.Namespace) -> None:
    from diffusion.v1 import runner_pb2_grpc
    from runner_service.model_roots import ModelRoots
    from runner_service.platforms import select_platform
    from runner_service.service import RunnerServicer

    platform = select_platform(args.device, args.spill_dir)
    limits = BatchLimits(max_batch_images=args.max_batch_images, max_size=args.max_size, max_steps=args.max_steps)
    servicer = RunnerServicer(platform, args.model_cache, ModelRoots(args.model_root), limits,
                              args.max_weights_bytes, args.max_adapters, args.batching == "step",
                              args.prompt_cache_bytes)
    token = read_token(args.auth_token_file)
    interceptors = [BearerTokenInterceptor(one_token(token))] if token else []
    server, health = create_server(args.listen, [RUNNER_SERVICE], max_message_bytes=args.max_message_bytes,
                                   interceptors=interceptors)
    runner_pb2_grpc.add_RunnerServiceServicer_to_server(servicer, server)
    await server.start()
    await health.set(RUNNER_SERVICE, NOT_SERVING)
    await health.set("", SERVING)
    if args.model:
        await servicer.load(args.model, args.dtype or None)
    await health.set(RUNNER_SERVICE, SERVING)
    logger.info("runner %s serving on %s, device %s", servicer.instance_id, args.listen, platform.describe())

    stopping = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            logger.info("%s: draining for up to %.0f s", signal.Signals(signum).name, args.grace)
            stopping.set()
        else:
            logger.warning("second signal: cancelling remaining work")
            asyncio.ensure_future(server.stop(0))

    install_shutdown_signals(asyncio.get_running_loop(), on_signal)
    await stopping.wait()
    await health.enter_graceful_shutdown()
    await server.stop(args.grace)
    platform.offload_store().close()
    logger.info("runner stopped")


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # started by deploy/pod.py: end with it
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    quiet_libraries()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    try:
        asyncio.run(serve(args))
    except ListenError as error:
        raise SystemExit(f"diffusion-runner: {error}") from None


if __name__ == "__main__":
    main()
