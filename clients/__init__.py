"""Clients of the diffusion worker: ``DiffusionClient`` (blocking) and ``AsyncDiffusionClient`` (asyncio).

Failed calls raise ``grpc.RpcError``; ``clients.field_violations(err)`` reads the fields an
INVALID_ARGUMENT named. The ``diffusion`` command line lives in ``clients.cli``.
"""

from clients.aio import AsyncDiffusionClient, AsyncEventStream
from clients.client import DiffusionClient, EventStream
from clients.connection import Connection
from clients.types import (
    Done,
    Event,
    GeneratedImage,
    GenerateResult,
    Progress,
    Queued,
    Started,
    Timings,
    build_generate_request,
)
from serving_common.errors import field_violations

__all__ = [
    "AsyncDiffusionClient",
    "AsyncEventStream",
    "Connection",
    "DiffusionClient",
    "Done",
    "Event",
    "EventStream",
    "GenerateResult",
    "GeneratedImage",
    "Progress",
    "Queued",
    "Started",
    "Timings",
    "build_generate_request",
    "field_violations",
]
