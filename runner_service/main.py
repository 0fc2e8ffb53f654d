"""diffusion-runner: the model-runner sidecar, pinned to one device. It loads diffusers pipelines
and runs their denoising for a diffusion worker (each flag also from DIFFUSION_RUNNER_<FLAG>).

torch and diffusers are imported once the flags are parsed: --help and a bad flag answer at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from runner_service.config import RunnerConfig
from runner_service.libraries import quiet_libraries
from serving_common.auth import BearerTokenInterceptor, one_token, read_token
from serving_common.config_flags import parse_config
from serving_common.logs import configure_logging
from serving_common.protocol import RUNNER_SERVICE
from serving_common.server import NOT_SERVING, SERVING, ListenError, create_server, install_shutdown_signals
from serving_common.supervision import die_with_parent

logger = logging.getLogger("runner_service")

def parse_args(argv: list[str] | None = None) -> RunnerConfig:
    """The runner's configuration, from its flags and DIFFUSION_RUNNER_<FLAG> variables."""
    return parse_config(RunnerConfig, argv, description=__doc__.split("\n\n")[0])


async def serve(config: RunnerConfig) -> None:
    from diffusion.v1 import runner_pb2_grpc
    from runner_service.core import ModelHost
    from runner_service.platforms import select_platform
    from runner_service.service import RunnerServicer

    platform = select_platform(config.device, config.spill_dir)
    host = ModelHost(platform, config)
    token = read_token(config.auth_token_file)
    interceptors = [BearerTokenInterceptor(one_token(token))] if token else []
    server, health = create_server(config.listen, [RUNNER_SERVICE], max_message_bytes=config.max_message_bytes,
                                   interceptors=interceptors)
    runner_pb2_grpc.add_RunnerServiceServicer_to_server(RunnerServicer(host), server)
    await server.start()
    await health.set(RUNNER_SERVICE, NOT_SERVING)
    await health.set("", SERVING)
    if config.model:
        await host.load(config.model, config.dtype or None)
    await health.set(RUNNER_SERVICE, SERVING)
    logger.info("runner %s serving on %s, device %s", host.instance_id, config.listen, platform.describe())

    stopping = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            logger.info("%s: draining for up to %.0f s", signal.Signals(signum).name, config.grace)
            stopping.set()
        else:
            logger.warning("second signal: cancelling remaining work")
            asyncio.ensure_future(server.stop(0))

    install_shutdown_signals(asyncio.get_running_loop(), on_signal)
    await stopping.wait()
    await health.enter_graceful_shutdown()
    await server.stop(config.grace)
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
