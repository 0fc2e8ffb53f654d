"""An asyncio gRPC server the standard way: health, reflection, message limits, shutdown signals."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES, keepalive_server_options, message_options

# The typed names of grpc's generic server-side types, as every servicer and interceptor uses them.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
MethodHandler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Awaitable["MethodHandler | None"]]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# gRPC's Python server binds with SO_REUSEPORT by default: a second instance started on a taken port
# would then share it silently and get every other connection. Off, a taken port fails the start.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


class ListenError(OSError):
    """The server cannot bind its address: the port is taken, or the address is not this host's."""


def create_server(
    listen: str,
    service_names: Iterable[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    options: Iterable[tuple[str, int]] = (),
    health_servicer: health.aio.HealthServicer | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An asyncio gRPC server bound to ``listen`` with the standard health service and reflection.

    ``listen`` (the services' ``--listen``) is ``host:port`` or ``unix:/path``; with ``credentials``
    the port is TLS. The port is the server's alone (no SO_REUSEPORT): ListenError when it cannot be
    bound. The caller registers its servicers, starts the server and sets health statuses; every
    service starts NOT_SERVING but ``""``, which reports the process alive.
    The server accepts the keepalive pings of ``channels.keepalive_options`` channels. Pass
    ``health_servicer`` when parts built before the server publish health.
    """
    server = grpc.aio.server(options=[*message_options(max_message_bytes), *keepalive_server_options(), *options,
                                      EXCLUSIVE_PORT],
                             interceptors=list(interceptors))
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
        bound = port != 0 or listen.startswith("unix:")
    except RuntimeError:  # grpc says no more than "Failed to bind"
        bound = False
    if not bound:
        raise ListenError(f"cannot listen on {listen} (--listen): the port is in use (is another instance "
                          "running?) or the address is not this host's")
    return server, health_servicer


_closing: set[asyncio.Task[None]] = set()  # closes under way (the loop keeps only weak references)


class _Registration:
    """Stands in for the server while generated code registers a service, keeping its handlers."""

    handlers: dict[str, MethodHandler]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, MethodHandler]) -> None:
        self.handlers = dict(handlers)


def generated_handlers(add_to_server: Callable[[Any, Any], None], servicer: object) -> dict[str, MethodHandler]:
    """The method handlers generated code (``add_<Service>Servicer_to_server``) would register for
    ``servicer``, by method name, to register changed with ``add_handlers``."""
    registration = _Registration()
    add_to_server(servicer, registration)
    return registration.handlers


def add_handlers(server: grpc.aio.Server, service: str, handlers: dict[str, MethodHandler]) -> None:
    """Registers ``service``'s method handlers as generated code does."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def raw_requests(handler: MethodHandler) -> MethodHandler:
    """A request-streaming, unary-response method's handler whose behaviour reads each request
    message as the bytes received, unparsed: for a stream that is relayed or read as it came."""
    behavior: Any = handler.stream_unary  # grpc's stubs type a handler's behaviour as the sync one
    return grpc.stream_unary_rpc_method_handler(behavior, None, handler.response_serializer)


def close_when_call_ends(context: Context, responses: AsyncGenerator[Any, None]) -> None:
    """Closes a streaming handler's generator as soon as its call ends, so that its ``finally``
    blocks (which give back what the call held) run then, not when it is garbage collected.

    A call cancelled while gRPC writes a response leaves the generator suspended at its ``yield``:
    gRPC stops the task that consumed it and never closes it, and the collector may take seconds to
    (a dropped stream kept its request queued and its runner computing for that long). A generator
    running at that moment (awaiting inside) gets the call's cancellation there, as before.
    """
    loop = asyncio.get_running_loop()

    def close() -> None:
        task = loop.create_task(_close(responses))  # a generator that has finished closes at once
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    # gRPC calls any callable with the context (the stubs name a class of their own).
    context.add_done_callback(cast(Any, lambda _: loop.call_soon_threadsafe(close)))


async def _close(responses: AsyncGenerator[Any, None]) -> None:
    with contextlib.suppress(RuntimeError):  # "already running": it is awaiting, and gets the cancellation
        await responses.aclose()


def install_shutdown_signals(loop: asyncio.AbstractEventLoop, on_signal: Callable[[int], object]) -> None:
    """Calls ``on_signal(signum)`` on SIGTERM and SIGINT, from the running asyncio loop."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
