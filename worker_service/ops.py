"""The operational side of the worker, wired in one place: metrics, tokens, TLS, message size,
the runner token and request-id propagation, and the idle timer (issue 6).

``main`` builds an ``Operations`` from the config, passes ``server_options()`` to
``create_server``, calls ``start`` once the scheduler and runners exist, and ``close`` at the end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from clients.auth import read_token, token_interceptors
from clients.logging_setup import request_id_interceptors

from .config import WorkerConfig
from .idle import IdleSleeper
from .metrics import ObservingInterceptor, WorkerMetrics, metrics_host
from .runner_client import RunnerClient
from .security import ConfigError, auth_interceptors, check_message_limit, server_credentials

logger = logging.getLogger(__name__)


def check_config(config: WorkerConfig) -> None:
    """Raises ConfigError (or OSError) for flags the worker must not start with: unreadable token or
    certificate files, a message limit below the largest response, bad idle or metrics settings."""
    check_message_limit(config.max_message_bytes, config.limits)
    for path in (config.ops_token_file, config.inference_token_file, config.runner_token_file):
        read_token(path)
    server_credentials(config)
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError("--metrics-port must be 0 (off) to 65535")
    if config.sleep_after_idle < 0 or config.idle_sleep_level not in (1, 2):
        raise ConfigError("--sleep-after-idle must be >= 0 and --idle-sleep-level 1 or 2")


class Operations:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.metrics = WorkerMetrics(config.limits)
        self.idle: IdleSleeper | None = None
        self._observer = ObservingInterceptor(self.metrics, self._on_call)
        RunnerClient.channel_interceptors = [*token_interceptors(read_token(config.runner_token_file)),
                                             *request_id_interceptors()]
        RunnerClient.max_message_bytes = config.max_message_bytes
        if config.metrics_port:  # bound first, so a taken port stops the worker before it serves
            host = metrics_host(config.listen)
            try:
                port = self.metrics.serve_http(host, config.metrics_port)
            except OSError as error:
                raise SystemExit(f"diffusion-worker: cannot serve metrics on {host}:{config.metrics_port}: "
                                 f"{error.strerror or error} (--metrics-port 0 turns metrics off)") from None
            logger.info("metrics on http://%s:%d/metrics", host, port)

    def _on_call(self, method: str, finished_ok: bool) -> None:
        if self.idle is not None:
            self.idle.on_call(method, finished_ok)

    def server_options(self) -> dict[str, Any]:
        """Keyword arguments for ``clients.rpc.create_server``: observing first, so refusals count."""
        return {
            "interceptors": [self._observer, *auth_interceptors(self.config)],
            "credentials": server_credentials(self.config),
            "max_message_bytes": self.config.max_message_bytes,
        }

    def start(self, scheduler: Any, lifecycle: Any, controller: Any,
              runners: Callable[[], Sequence[RunnerClient]]) -> list[asyncio.Task[None]]:
        """Binds the gauges and starts the idle timer; returns the tasks to cancel at stop."""
        config = self.config
        src = self.metrics.sources
        src.queue_depth = lambda: scheduler.queue_depth
        src.in_flight = lambda: scheduler.in_flight
        src.state = lambda: lifecycle.state
        src.sleep_level = lambda: (lifecycle.model.sleep_level
                                   if lifecycle.model is not None and lifecycle.sleeping_components else 0)
        src.runners = runners
        self.idle = IdleSleeper(config.sleep_after_idle, config.idle_sleep_level, controller, lifecycle,
                                scheduler, on_sleep=self._count_idle_sleep)
        self._observer.status_extenders = [self.idle.extend_status]
        return [asyncio.create_task(self.metrics.refresh_runners(), name="runner metrics"),
                asyncio.create_task(self.idle.run(), name="idle sleep")]

    def _count_idle_sleep(self) -> None:
        self.metrics.idle_sleeps += 1

    def close(self) -> None:
        self.metrics.close()
