"""Bearer-token authentication for gRPC, both ends: a server interceptor and client interceptors.

Tokens travel as ``authorization: Bearer <token>`` metadata. The health and reflection services
stay open, so Kubernetes probes and ``grpcurl list`` need no token.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc

from serving_common.server import Context, Continuation, MethodHandler

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# Maps a full method name ("/pkg.Service/Method") to the tokens that may call it; None: open.
TokenPolicy = Callable[[str], "tuple[str, ...] | None"]


def read_token(path: str | Path | None) -> str | None:
    """The token in a file (surrounding whitespace ignored); None when no file is configured."""
    if not path:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def _denied(handler: MethodHandler, code: grpc.StatusCode, message: str) -> MethodHandler:
    """A handler of the same streaming kind as ``handler`` that fails with ``code``."""

    async def deny(request_or_iterator: object, context: Context) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a token, PERMISSION_DENIED with one the method does not accept."""

    def __init__(self, policy: TokenPolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> MethodHandler | None:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        refused = refusal(self.policy(method), bearer_token(details.invocation_metadata), method)
        return handler if refused is None else _denied(handler, *refused)


def refusal(accepted: tuple[str, ...] | None, token: str | None, name: str) -> tuple[grpc.StatusCode, str] | None:
    """Why a caller presenting ``token`` may not call ``name``, whose policy accepts ``accepted``
    (None: open): UNAUTHENTICATED without a token, PERMISSION_DENIED with another one; None when
    allowed. Every transport (gRPC metadata, HTTP headers) decides with this."""
    if accepted is None:
        return None
    if token is None:
        return grpc.StatusCode.UNAUTHENTICATED, f"{name} needs a bearer token (authorization: Bearer <token>)"
    if not any(hmac.compare_digest(token.encode(), good.encode()) for good in accepted):
        return grpc.StatusCode.PERMISSION_DENIED, f"this token may not call {name}"
    return None


def one_token(token: str) -> TokenPolicy:
    """The policy of a service with one token for every method."""
    return lambda method: (token,)


class _AddMetadata:
    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return cast(grpc.aio.ClientCallDetails, details._replace(metadata=metadata))  # type: ignore[attr-defined]


class _UnaryUnaryToken(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStreamToken(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnaryToken(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def token_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """asyncio channel interceptors that send ``token`` with every call (none without a token)."""
    return [_UnaryUnaryToken(token), _UnaryStreamToken(token), _StreamUnaryToken(token)] if token else []
