"""Errors in OpenAI's shape, and the one mapping from ServiceError codes to HTTP statuses.

A body is ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API sends it, so its
SDKs raise the matching exception (``BadRequestError`` for 400, ``AuthenticationError`` for 401,
``RateLimitError`` for 429, ...). ``code`` is the gRPC status name in lower case
(``invalid_argument``, ``resource_exhausted``): what a gRPC caller would have been told.
``param`` names the OpenAI field at fault (the first, when several are). A refusal whose HTTP
status is not its code's is an ``HttpRefusal``: a body past its per-request cap (``BodyTooLarge``)
is 413, not 429, as no retry mends it; an image URL past its time is 410, a video not made yet 409.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import grpc
from starlette.responses import JSONResponse

from serving_common.errors import MAX_MESSAGE_CHARS, ServiceError
from serving_common.logs import REQUEST_ID_METADATA

Code = grpc.StatusCode

# gRPC code -> HTTP status and OpenAI error type. FAILED_PRECONDITION is the worker not being
# ready (no model, loading, asleep without --auto-wake), which a client retries later like
# UNAVAILABLE. CANCELLED (a Cancel RPC ended the request) is 499, Google's mapping of it.
STATUSES: Mapping[grpc.StatusCode, tuple[int, str]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.OUT_OF_RANGE: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.ALREADY_EXISTS: (409, "conflict_error"),
    Code.ABORTED: (409, "conflict_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.CANCELLED: (499, "cancelled_error"),
    Code.FAILED_PRECONDITION: (503, "service_unavailable_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
INTERNAL = (500, "server_error")  # INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED
TOO_LARGE = (413, "invalid_request_error")
# Seconds a client should wait before retrying a refusal for a full queue (OpenAI's SDKs honour it).
RETRY_AFTER_S = 1


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a gRPC status code."""
    return STATUSES.get(code, INTERNAL)


class HttpRefusal(ServiceError):
    """A refusal OpenAI's API answers with another HTTP status than its gRPC code's: ``http``, the
    status and OpenAI error type; ``param``, the field at fault. The code is for metrics and logs."""

    def __init__(self, code: grpc.StatusCode, message: str, http: tuple[int, str], param: str | None = None) -> None:
        super().__init__(code, message)
        self.http = http
        self.param = param


class BodyTooLarge(HttpRefusal):
    """A request body past its per-request cap: 413, which no retry mends (a full budget shared with
    other bodies is 429). RESOURCE_EXHAUSTED for metrics and logs, as gRPC says of a message past
    its limit."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message, TOO_LARGE)


class OpenAIError(Exception):
    """An HTTP error response in OpenAI's JSON shape."""

    def __init__(self, status: int, type_: str, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str = "") -> JSONResponse:
        headers = {**self.headers, **({REQUEST_ID_METADATA: request_id} if request_id else {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_service_error(error: ServiceError, param_of: Callable[[str], tuple[str, str]],
                       request_id: str = "") -> OpenAIError:
    """``error`` as OpenAI's API would say it; ``param_of`` turns a violation's (gRPC) field and
    description into the OpenAI field and a description that names it."""
    refusal = error if isinstance(error, HttpRefusal) else None
    status, type_ = refusal.http if refusal is not None else http_status(error.code)
    if error.code == Code.FAILED_PRECONDITION and error.violations:
        # A field names what is not there (a ControlNet not registered): no retry mends the request.
        status, type_ = STATUSES[Code.INVALID_ARGUMENT]
    violations = [param_of(field) + (description,) for field, description in error.violations]
    params = [refusal.param] if refusal is not None and refusal.param else [param for param, _, _ in violations]
    if status == INTERNAL[0]:
        message = f"internal error (request id {request_id or '-'}): {error.message}"
    else:
        message = error.message or "; ".join(f"{param}: {named}{description}" for param, named, description
                                               in violations)
    retry = error.code == Code.RESOURCE_EXHAUSTED and status == http_status(error.code)[0]  # not a body too large
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else {}
    if error.code == Code.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return OpenAIError(status, type_, clip(message), params[0] if params else None, error.code.name.lower(),
                       headers)


def internal_error(request_id: str) -> OpenAIError:
    """An unexpected failure: a short message with the request id; the details go to the log only."""
    return OpenAIError(*INTERNAL, f"internal error (request id {request_id or '-'}); the details are in the "
                       "server log", code="internal")


def clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
