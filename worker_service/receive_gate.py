"""Generate and GenerateStream receive their request only once one of a few receive slots is free.

gRPC's asyncio server reads a unary call's request message in full before its handler runs: it
posts the receive as each call arrives. 200 concurrent Generates with 12.6 MB images then put
2.5 GB into gRPC's buffers and Python bytes before the servicer could refuse one (issue 20
item 5). Served as request-streaming methods, a call's message is received only when its handler
reads it (grpc's aio server posts a receive per read of the request iterator), and until then its
bytes stay behind HTTP/2 flow control, at the client. On the wire a unary request is one message
and a half-close, so callers see no difference.

A gated call waits for a slot (at most until its deadline), reads its one message within
``--receive-timeout`` (so a slow or silent sender cannot keep a slot), makes sure nothing follows,
gives the slot back and goes on as the unary method: admission before decoding comes next.
Every other method stays unary and is never behind the gate.

A call that fails leaves a reference cycle that holds its request: gRPC keeps the abort exception
on the call's state, and the exception's traceback holds the handler frames, which hold the request
and the servicer context, which holds the call's state. Python's collector reaches such cycles late
(they outlive its young generations while the call runs): 200 refused 12.6 MB requests left the
worker holding 3.5 GB after they ended. So a collection runs once each failed gated call is done.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError

from diffusion.v1 import worker_pb2_grpc
from serving_common.deadlines import time_left
from serving_common.errors import ServiceError, invalid_argument
from serving_common.protocol import WORKER_SERVICE
from serving_common.server import Context, add_handlers, generated_handlers, raw_requests

# Set on the worker's server only. With BDP probing (on by default) gRPC's core grows each stream's
# initial HTTP/2 window to its estimate of the connection's bandwidth-delay product, which was about
# 4 MB on loopback: every call waiting for a slot then held 4 MB of its message in the worker (measured
# with 40 waiting 12.6 MB calls: +161 MB). Without it a waiting stream holds at most the lookahead,
# 64 KiB; a read still opens the window to the whole message it waits for.
RECEIVE_WINDOW_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 * 1024)]

T = TypeVar("T")
Request = TypeVar("Request")


class ReceiveGate:
    """At most ``slots`` gated calls receive their request message at once."""

    def __init__(self, slots: int, timeout: float) -> None:
        self._slots = asyncio.Semaphore(slots)
        self.timeout = timeout
        self.receiving = 0  # calls holding a slot
        self.waiting = 0  # calls waiting for one
        self._collection_due = False

    async def receive(self, requests: AsyncIterator[T], context: Context) -> T:
        """The one message of a call's request stream; raises ServiceError when the call's deadline
        passes before a slot is free, when the message takes longer than ``timeout`` to arrive, or
        when the stream does not hold exactly one message."""
        self.waiting += 1
        try:
            async with asyncio.timeout(time_left(context)):
                await self._slots.acquire()
        except TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while the call waited for "
                               "a receive slot (--max-receiving-requests)") from None
        finally:
            self.waiting -= 1
        self.receiving += 1
        try:
            async with asyncio.timeout(self.timeout):
                return await _one_message(requests)
        except TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request message did not arrive within "
                               f"{self.timeout:g} s of its receive slot (--receive-timeout)") from None
        finally:
            self.receiving -= 1
            self._slots.release()

    def collect_when_done(self, context: Context) -> None:
        """Collects garbage cycles once the call of ``context`` is done: one collection for the
        calls that end meanwhile."""
        loop = asyncio.get_running_loop()

        def due(_: Context) -> None:
            if not self._collection_due:
                self._collection_due = True
                loop.call_soon_threadsafe(self._collect)

        context.add_done_callback(cast(Any, due))  # grpc-stubs want a protocol no function matches

    def _collect(self) -> None:
        self._collection_due = False
        gc.collect()

    def unary(self, behavior: Callable[[Request, Context], Any]) -> Callable[[AsyncIterator[Request], Context], Any]:
        """A stream-unary handler that receives through the gate, then runs unary ``behavior``."""
        async def gated(requests: AsyncIterator[Request], context: Context) -> Any:
            request = await _received(self, requests, context)
            try:
                return await behavior(request, context)
            except BaseException:
                self.collect_when_done(context)
                raise

        return gated

    def streaming(self, behavior: Callable[[Request, Context], AsyncIterator[Any]]
                  ) -> Callable[[AsyncIterator[Request], Context], AsyncIterator[Any]]:
        """A stream-stream handler that receives through the gate, then runs unary-stream ``behavior``."""
        async def gated(requests: AsyncIterator[Request], context: Context) -> AsyncIterator[Any]:
            request = await _received(self, requests, context)
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException:
                self.collect_when_done(context)
                raise

        return gated


async def _one_message(requests: AsyncIterator[T]) -> T:
    try:
        request = await anext(requests, None)
        if request is None:
            raise invalid_argument({}, "the call ended without a request message")
        if await anext(requests, None) is not None:
            raise invalid_argument({}, "a call carries one request message; this one sent more")
    except DecodeError:
        raise invalid_argument({}, "the request message does not parse") from None
    return request


async def _received(gate: ReceiveGate, requests: AsyncIterator[T], context: Context) -> T:
    try:
        return await gate.receive(requests, context)
    except ServiceError as error:
        gate.collect_when_done(context)  # a message already read (one of two) is in the same cycle
        await error.abort(context)


def add_worker_service(servicer: worker_pb2_grpc.WorkerServiceServicer, gate: ReceiveGate,
                       server: grpc.aio.Server) -> None:
    """Registers WorkerService as the generated code does, but for Generate and GenerateStream,
    which are served request-streaming behind ``gate`` (same messages, same (de)serializers), and
    PushWeights, whose messages the servicer relays as received (``serving_common.push_wire``)."""
    handlers = generated_handlers(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)
    unary: Any = handlers["Generate"]  # grpc's stubs type a handler's behaviour as the sync one
    stream: Any = handlers["GenerateStream"]
    handlers["Generate"] = grpc.stream_unary_rpc_method_handler(
        gate.unary(unary.unary_unary), unary.request_deserializer, unary.response_serializer)
    handlers["GenerateStream"] = grpc.stream_stream_rpc_method_handler(
        gate.streaming(stream.unary_stream), stream.request_deserializer, stream.response_serializer)
    handlers["PushWeights"] = raw_requests(handlers["PushWeights"])
    add_handlers(server, WORKER_SERVICE, handlers)
