"""Guards on the HTTP port's connections, which uvicorn lacks: a cap on how many are open, and
deadlines for a request's headers and for its body.

Without them a client that sends ``POST / HTTP/1.1\\r\\nHost: x\\r\\n`` and then nothing holds a
connection (a file descriptor and its buffers) for ever, and enough of them took every
descriptor of the worker, gRPC's included (issue 20 item 2). ``GuardedH11Protocol`` is uvicorn's
h11 protocol with:

- a connection past ``max_connections`` answered 503 and closed before anything is read;
- a connection waiting for a request's headers (since it opened, or since the previous response)
  closed when they are not complete within ``header_timeout``;
- a connection sending a request's body closed when it is not complete within ``body_timeout``
  of the headers; the route reading it then sees the client gone, and its request is cancelled.

Once a request is received no deadline applies here: generating takes what it takes (the
request's own deadline is ``X-Request-Timeout``), and an idle keep-alive connection is closed by
uvicorn after ``timeout_keep_alive``. The bytes of bodies being read are bounded by the route
(``body.BodyBudget``); what one connection buffers by uvicorn (it stops reading at 64 KiB).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from worker_service.config import HttpLimits
from worker_service.http.errors import RETRY_AFTER_S, OpenAIError
from worker_service.http.throttled_log import ThrottledLog

logger = logging.getLogger(__name__)

_BUSY_BODY = json.dumps(OpenAIError(503, "service_unavailable_error", "too many HTTP connections are open; "
                                    "retry later", code="unavailable").body()).encode()
# Written before anything is read, so it is one fixed response.
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nretry-after: %d\r\nconnection: close\r\n\r\n" % (len(_BUSY_BODY), RETRY_AFTER_S)
        + _BUSY_BODY)

_refused = ThrottledLog(logger, logging.WARNING, "refused %d HTTP connection(s): --http-max-connections are open")
_timed_out = ThrottledLog(logger, logging.INFO, "closed %d HTTP connection(s) that sent no complete request "
                                                "headers or body in time (--http-header-timeout, --http-body-timeout)")


class _Wait(enum.Enum):
    HEADERS = "headers"
    BODY = "body"


class GuardedConfig(uvicorn.Config):
    """uvicorn's Config, serving with ``GuardedH11Protocol`` under ``limits``."""

    def __init__(self, app: Any, limits: HttpLimits, **options: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, **options)
        self.http_limits = limits


class GuardedH11Protocol(H11Protocol):
    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, GuardedConfig)
        self._limits = config.http_limits
        self._waiting: _Wait | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._limits.max_connections:
            _refused()
            transport.write(BUSY)
            transport.close()  # self.transport stays None: nothing else happens on this connection
            return
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:  # refused
            return
        self._set_deadline(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Arms the deadline of what the connection now waits for, when that changed."""
        if self.transport.is_closing():
            self._set_deadline(None)
            return
        state = self.conn.their_state
        waiting = _Wait.HEADERS if state is h11.IDLE else _Wait.BODY if state is h11.SEND_BODY else None
        if waiting is not self._waiting:
            self._set_deadline(waiting)

    def _set_deadline(self, waiting: _Wait | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting = waiting
        if waiting is not None:
            seconds = self._limits.header_timeout if waiting is _Wait.HEADERS else self._limits.body_timeout
            self._deadline = self.loop.call_later(seconds, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.debug("closing HTTP connection from %s: no complete request %s in time", self.client,
                         self._waiting.value if self._waiting else "")
            _timed_out()
            self.transport.close()
