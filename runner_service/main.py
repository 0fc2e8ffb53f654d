"""diffusion-runner: the model-runner sidecar, pinned to one device. It loads diffusers pipelines
and runs their denoising for a diffusion worker (each flag also from DIFFUSION_RUNNER_<FLAG>).

torch and diffusers are imported once the flags are parsed: --help and a bad flag answer at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from runner_service.config import RunnerConfig
from runner_service.libraries import quiet_libraries
from runner_service.overrun import exit_now
from serving_common.auth import BearerTokenInterceptor, one_token, read_token
from serving_common.config_flags import parse_config
from serving_common.logs import configure_logging
from serving_common.protocol import RUNNER_SERVICE
from serving_common.server import (
    NOT_SERVING,
    SERVING,
    ListenError,
    add_handlers,
    create_server,
    generated_handlers,
    install_shutdown_signals,
    raw_requests,
)
from serving_common.supervision import die_with_parent

if TYPE_CHECKING:
    from runner_service.core import ModelHost
    from runner_service.group import GroupMember

logger = logging.getLogger("runner_service")

def parse_args(argv: list[str] | None = None) -> RunnerConfig:
    """The runner's configuration, from its flags and DIFFUSION_RUNNER_<FLAG> variables."""
    return parse_config(RunnerConfig, argv, description=__doc__.split("\n\n")[0])


async def serve(config: RunnerConfig, member: GroupMember | None = None) -> None:
    """Serves the RunnerService: on one device, or as rank 0 of a runner group (``member``), whose
    followers are told to leave once it stops."""
    from runner_service.core import ModelHost
    from runner_service.platforms import select_platform

    platform = select_platform(member.device if member is not None else config.device, rank_spill_dir(config, member))
    host = ModelHost(platform, config, member)
    try:
        await _serve_host(config, host)
    finally:
        host.stop_group()


async def _serve_host(config: RunnerConfig, host: ModelHost) -> None:
    from diffusion.v1 import runner_pb2_grpc
    from runner_service.service import RunnerServicer

    platform = host.platform
    token = read_token(config.auth_token_file)
    interceptors = [BearerTokenInterceptor(one_token(token))] if token else []
    server, health = create_server(config.listen, [RUNNER_SERVICE], max_message_bytes=config.max_message_bytes,
                                   interceptors=interceptors)
    handlers = generated_handlers(runner_pb2_grpc.add_RunnerServiceServicer_to_server, RunnerServicer(host))
    handlers["PushWeights"] = raw_requests(handlers["PushWeights"])  # read as received (serving_common.push_wire)
    add_handlers(server, RUNNER_SERVICE, handlers)
    await server.start()
    await health.set(RUNNER_SERVICE, NOT_SERVING)
    await health.set("", SERVING)
    await host.describe_devices()
    if config.model:
        await host.load(config.model, config.dtype or None)
    await health.set(RUNNER_SERVICE, SERVING)
    host.gate.work.watch()
    logger.info("runner %s serving on %s, device %s%s", host.instance_id, config.listen, platform.describe(),
                f", rank 0 of {host.world_size}" if host.member is not None else "")

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
    busy = host.gate.work.busy_s()
    if busy:  # a group's followers end with rank 0 (launch.py)
        exit_now(0, f"runner stopped; its device work of the last {busy:.1f} s is not waited for (--grace "
                    f"{config.grace:g} s is over and a step cannot be interrupted)")
    logger.info("runner stopped")


def _set_up(config: RunnerConfig) -> None:
    """What every rank's process sets up first (a follower is a fresh interpreter)."""
    configure_logging(config.log_level, config.log_json)
    quiet_libraries(debug=config.log_level.upper() == "DEBUG")
    if config.threads > 0:
        import torch

        torch.set_num_threads(config.threads)


def rank_spill_dir(config: RunnerConfig, member: GroupMember | None) -> Path | None:
    """A rank's own spill directory (a spill directory serves one process): ``--spill-dir`` itself
    for rank 0 and a single runner, a ``rank-N`` folder inside it for the followers; None: each
    makes its own temporary one."""
    if config.spill_dir is None or member is None or member.rank == 0:
        return config.spill_dir
    return config.spill_dir / f"rank-{member.rank}"


def serve_rank(config: RunnerConfig, member: GroupMember) -> None:
    """One rank of a runner group: rank 0 serves, the others follow it until it stops them. A
    follower leaves signals to rank 0, which drains and then stops it."""
    if member.rank == 0:
        asyncio.run(serve(config, member))
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _set_up(config)  # before the imports below, which load the libraries it quietens
    from runner_service.core import ModelHost
    from runner_service.platforms import select_platform

    ModelHost(select_platform(member.device, rank_spill_dir(config, member)), config, member).follow()


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # started by deploy/pod.py: end with it
    args = parse_args(argv)
    _set_up(args)
    try:
        if not args.devices:
            asyncio.run(serve(args))
            return
        from runner_service.group import launch
        from runner_service.platforms import group_devices

        if args.model:
            raise SystemExit("diffusion-runner: --model with --devices: a group loads its model with the "
                             "parallel plan of the worker's Init")
        try:
            devices = group_devices(args.devices, args.device)
        except ValueError as error:
            raise SystemExit(f"diffusion-runner: {error}") from None
        launch(devices, functools.partial(serve_rank, args), heartbeat_timeout_s=args.group_heartbeat_timeout)
    except ListenError as error:
        raise SystemExit(f"diffusion-runner: {error}") from None


if __name__ == "__main__":
    main()
