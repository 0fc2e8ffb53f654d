"""The exceptions of the clients: one class per status a caller handles differently, under ``DiffusionError``.

    try:
        client.generate("a fox", width=65)
    except InvalidArgument as err:
        print(err.violations)        # {"width": "must be a multiple of 8 from 8 to 2048, got 65"}
    except ResourceExhausted as err:
        time.sleep(err.retry_after or 1)

Every one is also a ``grpc.RpcError`` with the same ``code()``, ``details()`` and
``trailing_metadata()`` as the failed call, so code that catches ``grpc.RpcError`` keeps working.
A status with no class of its own (INTERNAL, UNIMPLEMENTED, ...) raises ``DiffusionError`` itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from serving_common.errors import Violations, invalid_argument


class DiffusionError(grpc.RpcError):
    """A failed call: ``code()`` (a ``grpc.StatusCode``), ``message`` (= ``details()``), and ``status``,
    the ``google.rpc.Status`` with the server's rich details (None when it sent none)."""

    def __init__(self, code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None,
                 call: Any = None) -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self._code = code
        self.message = message
        self.status = status
        self._call = call  # the failed call, for its metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata() if self._call is not None else None

    def initial_metadata(self) -> Any:
        return self._call.initial_metadata() if self._call is not None else None

    def _details_of(self, kind: Any) -> Iterator[Any]:
        """The rich details of type ``kind`` (a google.rpc message class) the status carries."""
        for detail in self.status.details if self.status is not None else ():
            if detail.Is(kind.DESCRIPTOR):
                message = kind()
                detail.Unpack(message)
                yield message


class InvalidArgument(DiffusionError):
    """The request was refused: ``violations`` maps each field at fault to what is wrong with it."""

    @property
    def violations(self) -> dict[str, str]:
        return {v.field: v.description for bad in self._details_of(error_details_pb2.BadRequest)
                for v in bad.field_violations}


class NotFound(DiffusionError):
    """No such request, adapter or file."""


class FailedPrecondition(DiffusionError):
    """The worker is in the wrong state for the call (no model loaded, the model asleep, ...)."""


class ResourceExhausted(DiffusionError):
    """A queue or budget is full; ``retry_after`` is the seconds the server suggests waiting before
    trying again (its RetryInfo), or None when it suggests none (a retry would fail the same way)."""

    @property
    def retry_after(self) -> float | None:
        for info in self._details_of(error_details_pb2.RetryInfo):
            return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
        return None


class Unavailable(DiffusionError):
    """The worker cannot be reached, is draining, or has no ready runner; worth retrying later."""


class Cancelled(DiffusionError):
    """The call was cancelled: by the caller, by ``cancel``, or by the worker shutting down."""


class DeadlineExceeded(DiffusionError):
    """The call's deadline (``timeout``) passed first; the worker stops the request."""


class Unauthenticated(DiffusionError):
    """The method needs a bearer token and none was sent (``token=``)."""


class PermissionDenied(DiffusionError):
    """The token sent may not call this method (an inference token on an ops method, ...)."""


ERRORS: dict[grpc.StatusCode, type[DiffusionError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def from_rpc_error(error: grpc.RpcError) -> DiffusionError:
    """The typed error of a failed call (sync or asyncio), its rich details decoded."""
    if isinstance(error, DiffusionError):
        return error
    code = getattr(error, "code", None)
    if code is None:  # not a call's error: nothing more to read
        return DiffusionError(grpc.StatusCode.UNKNOWN, str(error))
    status_code: grpc.StatusCode = code()
    try:
        status = rpc_status.from_call(cast(grpc.Call, error))  # an AioRpcError is a call too
    except ValueError:  # details that contradict the status: keep the status, drop them
        status = None
    return ERRORS.get(status_code, DiffusionError)(status_code, error.details() or "", status, error)


class _Unsent(grpc.RpcError):
    """A call the client refused before sending it, standing for the failed call it would have been."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details

    def trailing_metadata(self) -> Any:
        return self._status.trailing_metadata

    def initial_metadata(self) -> Any:
        return ()


def refusal(violations: Violations) -> InvalidArgument:
    """The ``InvalidArgument`` of a request refused before it is sent, with the status the worker
    sends for the same violations (``serving_common.errors``): ``violations``, ``message`` and
    ``field_violations(err)`` read it as they read the worker's."""
    return cast(InvalidArgument, from_rpc_error(_Unsent(invalid_argument(violations).to_status())))


@contextmanager
def typed_errors() -> Iterator[None]:
    """Raises the typed error of any ``grpc.RpcError`` raised inside (the original as its cause)."""
    try:
        yield
    except DiffusionError:
        raise
    except grpc.RpcError as error:
        raise from_rpc_error(error) from error


Client = TypeVar("Client", bound=type)


def _typed(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def typed_coroutine(*args: Any, **kwargs: Any) -> Any:
            with typed_errors():
                return await method(*args, **kwargs)

        return typed_coroutine

    @functools.wraps(method)
    def typed_call(*args: Any, **kwargs: Any) -> Any:
        with typed_errors():
            return method(*args, **kwargs)

    return typed_call


def raises_typed_errors(cls: Client) -> Client:
    """Class decorator: every public method of ``cls`` (coroutines included) raises typed errors, so
    no call of a client can forget to. Streams convert the errors of their iteration themselves."""
    for name, method in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(method):
            setattr(cls, name, _typed(method))
    return cls
