"""Uvicorn inside the worker's own asyncio event loop: no thread, no second process.

The socket is bound by ``HttpServer(...)`` before anything serves, so a taken port stops the
worker at once (as the metrics port does); ``start`` serves on it as a task of the running loop;
``stop`` closes the listener and the open connections, letting responses in progress finish
within ``STOP_GRACE_S``. Uvicorn's signal handlers are left out: the worker owns SIGTERM and
SIGINT and calls ``stop`` once generation has drained. With ``--tls-cert`` the port is HTTPS with
the gRPC port's certificate (and client certificates with ``--tls-client-ca``), so tokens never
travel in the clear when the gRPC port is TLS.

Connections are guarded (``connections``): at most ``--http-max-connections`` at once, each with
deadlines for its request's headers and body. A failed accept (out of file descriptors, say) is
logged once per interval with a count, not once per attempt with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from worker_service.config import WorkerConfig
from worker_service.http.connections import GuardedConfig
from worker_service.http.throttled_log import ThrottledLog

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2
# What asyncio says when accept() fails for want of descriptors or memory (EMFILE, ENFILE, ...).
ACCEPT_FAILED = "socket.accept() out of system resource"
# Descriptors the worker needs besides HTTP connections: gRPC clients and runners, logs, files.
OTHER_DESCRIPTORS = 256


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the worker's loop.add_signal_handler stays in place


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (OSError when taken); uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def _check_descriptors(max_connections: int) -> None:
    """Warns when ``max_connections`` could take the descriptors gRPC needs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + OTHER_DESCRIPTORS > soft:
        logger.warning("--http-max-connections %d leaves fewer than %d of the %d file descriptors this process may "
                       "open for gRPC and the runners: lower it, or raise the limit (ulimit -n)", max_connections,
                       OTHER_DESCRIPTORS, soft)


class HttpServer:
    """One ASGI app served on one bound socket, in the running event loop."""

    def __init__(self, app: ASGIApp, host: str, port: int, config: WorkerConfig) -> None:
        self._socket = bind(host, port)
        tls = bool(config.tls_cert)
        self.scheme = "https" if tls else "http"
        self._server = _EmbeddedServer(GuardedConfig(
            app, config.http_limits, lifespan="off", log_config=None, access_log=False, server_header=False,
            timeout_graceful_shutdown=STOP_GRACE_S,
            ssl_certfile=config.tls_cert or None, ssl_keyfile=config.tls_key or None,
            ssl_ca_certs=config.tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and config.tls_client_ca else ssl.CERT_NONE))
        self._task: asyncio.Task[None] | None = None
        self._accept_failed = ThrottledLog(logger, logging.ERROR, "the HTTP port could not accept %d "
                                           "connection(s): out of file descriptors or memory")
        _check_descriptors(config.http_limits.max_connections)

    @property
    def port(self) -> int:
        port: int = self._socket.getsockname()[1]
        return port

    def start(self) -> None:
        self._quiet_accept_errors(asyncio.get_running_loop())
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http")
        self._task.add_done_callback(self._ended)

    def _quiet_accept_errors(self, loop: asyncio.AbstractEventLoop) -> None:
        """asyncio logs each failed accept of this socket with a traceback (and retries a second
        later); these go to a throttled line instead. Everything else goes where it went."""
        previous = loop.get_exception_handler()
        listening = self._socket.fileno()

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            sock = context.get("socket")
            if context.get("message") == ACCEPT_FAILED and sock is not None and sock.fileno() == listening:
                self._accept_failed()
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handle)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the HTTP server stopped", exc_info=task.exception())

    async def stop(self) -> None:
        """Stops serving; returns once uvicorn has closed its connections (or the grace ran out)."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):  # already logged by _ended
            await self._task
