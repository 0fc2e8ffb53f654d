"""Logging setup shared by the worker and the runner: plain text, or one JSON object per line.

Torch-free. A record logged with ``extra={"request_id": ...}`` carries the id as a JSON field
(and as a ``[request_id]`` suffix in plain text), so one request can be followed from the
worker's log into the runner's.
"""

from __future__ import annotations

import json
import logging

import grpc

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


REQUEST_ID_METADATA = "x-request-id"


def request_ids_of(metadata: object) -> str:
    """The ``x-request-id`` value of invocation metadata ("" when absent)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == REQUEST_ID_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""


def _execute_request_ids(request: object) -> str:
    items = getattr(request, "items", None)
    if items is None:
        return ""
    return ",".join(item.request_id for item in items if getattr(item, "request_id", ""))


class _RequestIdMetadata:
    """asyncio client interceptor: sends the request ids of a runner ExecuteRequest as ``x-request-id``
    (comma-separated for a batch), so the runner's log lines name the requests they serve."""

    def _details(self, details, request):  # type: ignore[no-untyped-def]
        ids = _execute_request_ids(request)
        if not ids:
            return details
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (REQUEST_ID_METADATA, ids)))


class _UnaryStreamRequestId(_RequestIdMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details, request), request)


def request_id_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a runner channel: Execute calls carry ``x-request-id``."""
    return [_UnaryStreamRequestId()]
