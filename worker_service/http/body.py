"""Reading a request body: bounded per request and over all requests, parsed as JSON safely.

800 connections each sending all but 89 bytes of a declared 1 MiB body took the worker from
102 to 921 MB, and 864 MB stayed after they closed (issue 20 item 2). So:

- a body is at most ``MAX_BODY_BYTES`` (400 when it declares or sends more);
- the bytes of all bodies being read or parsed count against one ``BodyBudget``
  (``--http-max-body-bytes-in-flight``): a chunk past it is refused RESOURCE_EXHAUSTED (429,
  retry) before more of that body is read;
- once a large body is parsed and dropped, freed heap goes back to the OS (glibc keeps it
  otherwise; ``serving_common.memory``).

Parsing refuses what ``json.loads`` takes beyond JSON (``NaN``, ``Infinity``) and nesting deep
enough to raise RecursionError, each as a 400 on the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from starlette.requests import Request

from serving_common.errors import ServiceError, invalid_argument
from serving_common.memory import HeapTrimmer
from worker_service.http.errors import RETRY_AFTER_S
from worker_service.http.params import decimal_int

# A body holds a prompt and a few numbers; prompts are bounded by --max-prompt-chars anyway.
MAX_BODY_BYTES = 1 << 20
# Bodies from this size on are worth handing back to the OS once parsed.
TRIM_AFTER_BYTES = 64 * 1024
_TRIMMER = HeapTrimmer()


class BodyBudget:
    """Bytes of request bodies held at once, over every connection of the HTTP port."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, size: int) -> None:
        """Counts ``size`` more bytes; RESOURCE_EXHAUSTED (nothing counted) when they do not fit."""
        if self.held + size > self.max_bytes:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the worker is receiving {self.max_bytes} bytes of request bodies already "
                               "(--http-max-body-bytes-in-flight); retry later", retry_after=RETRY_AFTER_S)
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size


async def read_json(request: Request, budget: BodyBudget) -> object:
    """The body as JSON, at most MAX_BODY_BYTES (whatever Content-Type says: curl -d sends form)."""
    too_big = invalid_argument((), f"the request body is larger than {MAX_BODY_BYTES} bytes")
    async with receiving(request, budget, MAX_BODY_BYTES, too_big) as chunks:
        return parse_json(b"".join([chunk async for chunk in chunks]))


@contextlib.asynccontextmanager
async def receiving(request: Request, budget: BodyBudget, max_bytes: int,
                    too_big: ServiceError) -> AsyncIterator[AsyncGenerator[bytes, None]]:
    """The body's chunks as they arrive. A body that declares or sends more than ``max_bytes`` is
    refused with ``too_big`` before more of it is read; each chunk counts against ``budget`` until
    the block ends, when its bytes are given back (and, after a large body, the freed heap)."""
    declared = decimal_int(request.headers.get("content-length", ""))
    if declared is not None and declared > max_bytes:
        raise too_big
    size = 0

    async def chunks() -> AsyncGenerator[bytes, None]:
        nonlocal size
        async for chunk in request.stream():
            if size + len(chunk) > max_bytes:
                raise too_big
            budget.take(len(chunk))
            size += len(chunk)
            yield chunk

    stream = chunks()
    try:
        yield stream
    finally:
        await stream.aclose()
        budget.give_back(size)
        if size >= TRIM_AFTER_BYTES:  # once this coroutine step has dropped the body and its parse
            asyncio.get_running_loop().call_soon(_TRIMMER.request)


def parse_json(data: bytes) -> object:
    """``data`` as strict JSON; INVALID_ARGUMENT on the body when it is not."""
    try:
        return json.loads(data, parse_constant=_not_json)
    except RecursionError:
        raise invalid_argument((), "the request body is nested too deeply") from None
    except ValueError as error:
        raise invalid_argument((), f"the request body is not valid JSON: {error}") from None


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON value")
