"""A gRPC failure that travels through the worker and ends a call with the same status."""

from __future__ import annotations

from typing import NoReturn

import grpc
from grpc_status import rpc_status


class RpcFailure(Exception):
    """A status to end a call with: a code, a message and, when forwarded, the rich details."""

    def __init__(self, code: grpc.StatusCode, message: str, status: grpc.Status | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError, target: str) -> RpcFailure:
        """The runner's own status, details included; an unreachable runner says which one."""
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return cls(code, f"runner {target} cannot be reached: {error.details()}")
        status = rpc_status.from_call(error)
        return cls(code, error.details() or code.name,
                   rpc_status.to_status(status) if status is not None else None)

    async def abort(self, context: grpc.aio.ServicerContext) -> NoReturn:
        if self.status is not None:
            await context.abort_with_status(self.status)
        await context.abort(self.code, self.message)
        raise AssertionError("unreachable")  # abort always raises
