"""The one error type of every service, and the one place that turns errors into gRPC statuses.

Domain code raises ``ServiceError`` (or lets a bug raise anything else); servicer methods are
wrapped in ``reports_errors``, which ends the call with the error's status. A status stays short
whatever the error holds: messages and ``BadRequest`` violations are capped, so a status never
outgrows gRPC's metadata limit and comes back RESOURCE_EXHAUSTED instead of its real code. An
unexpected exception becomes INTERNAL with the request id; its details go to the log only.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from serving_common.logs import request_ids_of
from serving_common.server import Context, close_when_call_ends

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000
MAX_VIOLATIONS = 10
MAX_DESCRIPTION_CHARS = 300

Violations = Mapping[str, str] | Iterable[tuple[str, str]]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cap_violations(violations: Violations) -> list[tuple[str, str]]:
    """At most ``MAX_VIOLATIONS`` (field, description) pairs, the last one saying how many more there were."""
    items = list(violations.items() if isinstance(violations, Mapping) else violations)
    kept = [(_clip(field, MAX_DESCRIPTION_CHARS), _clip(why, MAX_DESCRIPTION_CHARS)) for field, why in
            items[:MAX_VIOLATIONS]]
    if len(items) > MAX_VIOLATIONS:
        kept.append(("...", f"{len(items)} violations in all, the first {MAX_VIOLATIONS} shown"))
    return kept


class ServiceError(Exception):
    """A status to end a call with: a code, a short message and, for bad input, the fields at fault.

    ``status`` carries rich details as they came from another service (the runner), to be
    forwarded unchanged. ``retry_after``: seconds a caller should wait before trying again, sent
    as ``RetryInfo`` (only where a retry can succeed, such as a full queue).
    """

    def __init__(self, code: grpc.StatusCode, message: str, violations: Violations | None = None,
                 status: grpc.Status | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = cap_violations(violations or ())
        self.status = status
        self.retry_after = retry_after

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError, peer: str) -> ServiceError:
        """Another service's status, details included; an unreachable peer says which one."""
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return cls(code, f"runner {peer} cannot be reached: {error.details()}")
        status = rpc_status.from_call(cast(grpc.Call, error))  # an AioRpcError is a call, whatever the stubs say
        return cls(code, error.details() or code.name, status=rpc_status.to_status(status) if status else None)

    def to_status(self) -> grpc.Status:
        if self.status is not None:
            return self.status
        text = _clip(self.message or "; ".join(f"{f}: {d}" for f, d in self.violations), MAX_MESSAGE_CHARS)
        proto = status_pb2.Status(code=self.code.value[0], message=text)
        if self.violations:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                for field, description in self.violations]))
            proto.details.append(detail)
        if self.retry_after is not None:
            retry = error_details_pb2.RetryInfo()
            retry.retry_delay.FromTimedelta(datetime.timedelta(seconds=self.retry_after))
            proto.details.add().Pack(retry)
        status: grpc.Status = rpc_status.to_status(proto)
        return status

    async def abort(self, context: Context) -> NoReturn:
        await context.abort_with_status(self.to_status())
        raise AssertionError("unreachable")  # abort always raises


def invalid_argument(violations: Violations, message: str = "") -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, violations)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def field_violations(error: grpc.Call) -> dict[str, str]:
    """Reads the ``BadRequest`` field violations of a failed call (empty when there are none)."""
    status = rpc_status.from_call(error)
    found: dict[str, str] = {}
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found.update({v.field: v.description for v in bad.field_violations})
    return found


Handler = TypeVar("Handler", bound=Callable[..., Any])


async def _report(error: Exception, method: str, context: Context) -> NoReturn:
    if isinstance(error, ServiceError):
        await error.abort(context)
    request_id = request_ids_of(context.invocation_metadata()) or "-"
    logger.error("%s failed unexpectedly (request id %s)", method, request_id, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error in {method} (request id {request_id}); the details are in the server log")
    raise AssertionError("unreachable")


def reports_errors(handler: Handler) -> Handler:
    """Wraps a servicer method (unary or streaming): a ServiceError ends the call with its status,
    any other exception with INTERNAL. Aborts and cancellations pass through. A streaming method is
    closed as soon as its call ends (``close_when_call_ends``)."""
    method = handler.__name__
    passthrough = (grpc.aio.AbortError,)

    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def streaming(self: object, request: object, context: Context) -> Any:
            responses = handler(self, request, context)
            close_when_call_ends(context, responses)
            try:
                async for response in responses:
                    yield response
            except passthrough:
                raise
            except Exception as error:  # noqa: BLE001 - the one place errors become statuses
                await _report(error, method, context)

        return streaming  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: object, request: object, context: Context) -> Any:
        try:
            return await handler(self, request, context)
        except passthrough:
            raise
        except Exception as error:  # noqa: BLE001 - the one place errors become statuses
            await _report(error, method, context)

    return unary  # type: ignore[return-value]
