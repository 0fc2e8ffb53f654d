"""Clients of the diffusion worker: ``DiffusionClient`` (blocking) and ``AsyncDiffusionClient`` (asyncio),
for images (``generate``, ``stream``) and videos (``generate_video``).

A failed call raises a ``DiffusionError`` subclass per status (``clients.errors``), each also a
``grpc.RpcError``. The ``diffusion`` command line lives in ``clients.cli``.
"""

from clients.aio import AsyncDiffusionClient, AsyncEventStream
from clients.client import DiffusionClient, EventStream
from clients.conditioning import Control, ImagePrompt
from clients.connection import Connection
from clients.errors import (
    Cancelled,
    DeadlineExceeded,
    DiffusionError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from clients.types import (
    Chunk,
    Done,
    Event,
    GeneratedImage,
    GenerateResult,
    Progress,
    PushResult,
    Queued,
    Started,
    Timings,
    VideoResult,
    build_generate_request,
    build_video_request,
)
from serving_common.errors import field_violations

__all__ = [
    "AsyncDiffusionClient",
    "AsyncEventStream",
    "Cancelled",
    "Chunk",
    "Connection",
    "Control",
    "DeadlineExceeded",
    "DiffusionClient",
    "DiffusionError",
    "Done",
    "Event",
    "EventStream",
    "FailedPrecondition",
    "GenerateResult",
    "GeneratedImage",
    "ImagePrompt",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Progress",
    "PushResult",
    "Queued",
    "ResourceExhausted",
    "Started",
    "Timings",
    "Unauthenticated",
    "Unavailable",
    "VideoResult",
    "build_generate_request",
    "build_video_request",
    "field_violations",
]
