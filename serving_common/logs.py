"""Logging for every service: plain text, or one JSON object per line, and request ids in metadata.

A record logged with ``extra={"request_id": ...}`` carries the id as a JSON field (and as a
``[request_id=...]`` suffix in plain text), so one request can be followed from the worker's
log into the runner's: the worker sends the ids of a call as ``x-request-id`` metadata.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import grpc

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A call's request ids: the worker's metadata on the runner's calls, and the HTTP API's header (the
# caller's id, where it sent one, and the answer's).
REQUEST_ID_METADATA = "x-request-id"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{text} [request_id={request_id}]" if request_id else text


def configure_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def request_ids_of(metadata: Any) -> str:
    """The ``x-request-id`` value of invocation metadata ("" when absent)."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""


RequestIds = Callable[[Any], str]


class _UnaryStreamRequestId(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, ids_of: RequestIds) -> None:
        self._ids_of = ids_of

    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        ids = self._ids_of(request)
        if ids:
            details = details._replace(  # type: ignore[attr-defined]
                metadata=grpc.aio.Metadata(*(details.metadata or ()), (REQUEST_ID_METADATA, ids)))
        return await continuation(details, request)


def request_id_interceptors(ids_of: RequestIds) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a channel whose server-streaming calls carry ``x-request-id``: ``ids_of(request)``
    names the requests a call serves (comma-separated for a batch; "" sends nothing)."""
    return [_UnaryStreamRequestId(ids_of)]
