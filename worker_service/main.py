"""diffusion-worker: the front of a diffusion serving pod. It admits, queues and batches image requests
for its runners and owns the model's lifecycle (each flag also from DIFFUSION_WORKER_<FLAG>).

Its flags are the fields of worker_service.config.WorkerConfig; worker_service.app wires and serves.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from serving_common.auth import read_token
from serving_common.config_flags import flags, parse_config
from serving_common.input_rules import AccelerationPlan, acceleration_violations
from serving_common.load_extras import extras_violations
from serving_common.logs import configure_logging
from serving_common.server import ListenError
from serving_common.supervision import die_with_parent
from worker_service.app import serve
from worker_service.config import WorkerConfig
from worker_service.security import ConfigError, check_message_limit, server_credentials


def parse_args(argv: Sequence[str] | None = None) -> tuple[WorkerConfig, str, bool]:
    """The worker's configuration, the log level and whether logs are JSON."""
    config = parse_config(WorkerConfig, argv, description=__doc__.split("\n\n")[0], check=check_config)
    return config, config.log_level, config.log_json


def check_config(config: WorkerConfig) -> None:
    """Raises ConfigError (or OSError) for what no single flag's bounds say: two --runner flags for
    one target, --min-size above --max-size, model flags Init would refuse, a message limit below the
    largest response, unreadable token or certificate files."""
    acceleration = acceleration_violations(config.acceleration.to_proto())
    if acceleration:
        names = {flag.field: flag.name for flag in flags(AccelerationPlan)}
        raise ConfigError("; ".join(f"argument {names[field.removeprefix('acceleration.')]}: {problem}"
                                    for field, problem in acceleration))
    extras = extras_violations(config.component_overrides(), config.fused_adapters())
    if extras:
        raise ConfigError("; ".join(f"--component/--fuse-lora {field}: {problem}" for field, problem in extras))
    if len(set(config.runners)) != len(config.runners):
        raise ConfigError("each --runner must be a different target")
    if config.limits.min_size > config.limits.max_size:
        raise ConfigError("--min-size must be <= --max-size")
    check_message_limit(config.max_message_bytes, config.limits)
    for path in (config.ops_token_file, config.inference_token_file, config.runner_token_file):
        read_token(path)
    server_credentials(config)


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
