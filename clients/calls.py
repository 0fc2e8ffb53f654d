"""The calls of ``diffusion.v1.WorkerService`` (and gRPC health) that both clients make, each written
once: ``WorkerCalls`` is their table, which ``DiffusionClient`` and ``AsyncDiffusionClient`` inherit through
``BlockingCalls`` and ``AwaitedCalls`` (what the typed methods are told apart by, so this module needs
neither client).

A method with one response is a ``client_method``: written as a function that builds the ``Call``
(the stub's method, the request made from the arguments, what the response becomes), it is a
blocking method of ``DiffusionClient`` and a coroutine of ``AsyncDiffusionClient``, with the same
signature and docstring; each client says how it makes a call (its ``_call``). ``stream`` and
``stream_video`` return the client's own stream (``_events``). Every method raises the typed
errors of ``clients.errors``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, cast, overload

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from clients import push, types
from clients.connection import ClientBase
from clients.errors import raises_typed_errors, typed_errors
from clients.push import ProgressCallback, Weights
from clients.types import GenerateResult, PushResult
from diffusion.v1 import common_pb2, worker_pb2
from serving_common.protocol import WORKER_SERVICE
from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES

P = ParamSpec("P")
R = TypeVar("R")
Events = TypeVar("Events")  # the stream a client's GenerateStream calls return


def _as_sent(response: Any) -> Any:
    return response


@dataclass(frozen=True)
class Call(Generic[R]):
    """One call with one response: ``rpc``, the method of ``service``'s stub; ``request``, its
    message (PushWeights: an iterator of them, the client stream, already serialized where
    ``serialized``); ``result``, what the client method returns of the response (the response
    itself by default)."""

    rpc: str
    request: Message | Iterator[Message] | Iterator[bytes]
    timeout: float | None
    result: Callable[[Any], R] = field(default=_as_sent)
    service: Literal["worker", "health"] = "worker"
    serialized: bool = False


def _like(method: Any, spec: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` named, documented and signed as ``spec``, but returning what ``spec``'s ``Call``
    results in (``Call[str]``: ``str``), as ``help()`` and ``inspect.signature`` show it."""
    functools.update_wrapper(method, spec)
    signature = inspect.signature(spec)
    returned = signature.return_annotation
    if isinstance(returned, str) and returned.startswith("Call[") and returned.endswith("]"):
        method.__signature__ = signature.replace(return_annotation=returned[len("Call["):-1])
    else:
        method.__signature__ = signature.replace(return_annotation=inspect.Signature.empty)
    return cast(Callable[..., Any], method)


class client_method(Generic[P, R]):
    """A method made from ``spec``, the function that builds its ``Call``: blocking on
    ``DiffusionClient``, a coroutine on ``AsyncDiffusionClient`` (a client whose ``_call`` is one).
    Errors raise as ``clients.errors`` types, those of building the request included."""

    def __init__(self, spec: Callable[Concatenate[Any, P], Call[R]]) -> None:
        def blocking(client: Any, *args: Any, **kwargs: Any) -> Any:
            with typed_errors():
                return client._call(spec(client, *args, **kwargs))

        async def awaiting(client: Any, *args: Any, **kwargs: Any) -> Any:
            with typed_errors():
                return await client._call(spec(client, *args, **kwargs))

        self._blocking, self._awaiting = _like(blocking, spec), _like(awaiting, spec)

    def _method(self, owner: type) -> Callable[..., Any]:
        return self._awaiting if inspect.iscoroutinefunction(getattr(owner, "_call", None)) else self._blocking

    @overload
    def __get__(self, client: AwaitedCalls[Any], owner: type | None = None
                ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, client: BlockingCalls[Any], owner: type | None = None) -> Callable[P, R]: ...

    @overload
    def __get__(self, client: None, owner: type) -> Callable[..., Any]: ...

    def __get__(self, client: object, owner: type | None = None) -> Callable[..., Any]:
        method = self._method(owner if owner is not None else type(client))
        return method if client is None else MethodType(method, client)


@raises_typed_errors
class WorkerCalls(ClientBase, Generic[Events]):
    """The calls of both clients; ``DiffusionClient`` blocks on them, ``AsyncDiffusionClient`` awaits them."""

    # Each client defines ``_call(call)``, which makes a Call and returns its result (a coroutine
    # of ``AsyncDiffusionClient``: its methods are coroutines then).

    def _rpc(self, call: Call[Any]) -> Any:
        """The stub's method that makes ``call``: a ``grpc`` or a ``grpc.aio`` multi-callable."""
        if call.serialized:
            return self._serialized[call.rpc]
        return getattr(self._health if call.service == "health" else self._stub, call.rpc)

    def _events(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> Events:
        """The events of a GenerateStream call of ``request``, as the client's own stream."""
        raise NotImplementedError

    def _deadline(self, timeout: float | None) -> float | None:
        """When a call of ``timeout`` (None: the client's) must end, in ``time.monotonic()`` seconds."""
        limit = self._options(timeout)["timeout"]
        return None if limit is None else time.monotonic() + limit

    @contextlib.contextmanager
    def _health_watch(self, service: str, deadline: float | None) -> Iterator[Any]:
        """A health Watch of ``service`` that waits for the worker to listen, until ``deadline``;
        cancelled when the block ends, which ends quietly when the worker goes away (UNAVAILABLE: a
        restart, to be watched again)."""
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        watch = self._health.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True,
                                   timeout=remaining, metadata=self._metadata)
        try:
            yield watch
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        finally:
            watch.cancel()

    @client_method
    def generate(self, /, prompt: str, *, timeout: float | None = None, **options: Any) -> Call[GenerateResult]:
        """Generates images and returns them when all are done (None: the worker's default).

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        # (``self`` is positional-only, as ``options`` may take any other name.)
        return Call("Generate", types.build_generate_request(prompt, **options), timeout, GenerateResult.from_proto)

    def stream(self, prompt: str, *, timeout: float | None = None, **options: Any) -> Events:
        """Like ``generate``, but yields Queued, Started and Progress events before Done.

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        return self._events(types.build_generate_request(prompt, **options), timeout)

    def stream_video(self, prompt: str, *, timeout: float | None = None, **options: Any) -> Events:
        """Like ``generate_video``, but yields its events: Queued, Started, Progress (of each phase),
        the video's Chunks, then Done, whose ``result.video()`` is the video.

        ``options`` are those of ``clients.types.build_video_request``.
        """
        return self._events(types.build_video_request(prompt, **options), timeout)

    @client_method
    def cancel(self, request_id: str, *, timeout: float | None = None) -> Call[str]:
        """Cancels a queued or running request; returns where it was ("queued" or "running")."""
        return Call("Cancel", worker_pb2.CancelRequest(request_id=request_id), timeout, _was)

    @client_method
    def status(self, *, timeout: float | None = None) -> Call[worker_pb2.GetStatusResponse]:
        """The worker's state, model, runners, queue and weights version."""
        return Call("GetStatus", worker_pb2.GetStatusRequest(), timeout)

    @client_method
    def init(self, model: str, dtype: str | int | None = None, *,
             acceleration: common_pb2.Acceleration | Mapping[str, Any] | None = None,
             parallel: common_pb2.Parallelism | Mapping[str, Any] | None = None,
             component_overrides: Iterable[common_pb2.ComponentOverride] = (),
             fused_adapters: Iterable[common_pb2.FusedAdapter] = (),
             timeout: float | None = None) -> Call[worker_pb2.InitResponse]:
        """Loads ``model`` (a built-in name or a directory on the runner's filesystem), accelerated as
        ``acceleration`` says and spread over each runner's devices as ``parallel`` says, with its
        ``component_overrides`` and ``fused_adapters`` (``types.build_init_request``)."""
        return Call("Init", types.build_init_request(model, dtype, acceleration, parallel, component_overrides,
                                                     fused_adapters), timeout)

    @client_method
    def sleep(self, level: int = 1, tags: Iterable[str] = (), *,
              timeout: float | None = None) -> Call[worker_pb2.SleepResponse]:
        """Puts the model to sleep once the requests in flight have finished: ``level`` 1 offloads
        its weights to host memory, 2 discards them; ``tags``: those components only (empty: all)."""
        return Call("Sleep", types.build_sleep_request(level, tags), timeout)

    @client_method
    def wake(self, tags: Iterable[str] = (), *, timeout: float | None = None) -> Call[worker_pb2.WakeUpResponse]:
        """Wakes the components ``tags`` names (empty: all) of a sleeping model."""
        return Call("WakeUp", types.build_wake_request(tags), timeout)

    @client_method
    def load_weights(self, path: str, *, timeout: float | None = None) -> Call[worker_pb2.LoadWeightsResponse]:
        """Loads safetensors weights from ``path`` on the runner's filesystem."""
        return Call("LoadWeights", worker_pb2.LoadWeightsRequest(path=path), timeout)

    @client_method
    def push_weights(self, weights: Weights, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     on_progress: ProgressCallback | None = None,
                     timeout: float | None = None) -> Call[PushResult]:
        """Streams ``weights`` to the worker, which applies them on every runner, all or nothing.

        ``weights``: a state dict named "<component>.<parameter>" (``unet.conv_in.weight``), or the
        path of a .safetensors file on this machine, read one tensor at a time. Messages carry at
        most ``chunk_bytes`` of data (small tensors packed together); ``on_progress(bytes_sent,
        total_bytes)`` follows each, called from the
        thread that sends the stream (the asyncio client reads the stream in a thread, not in the
        event loop). A state dict's tensors are read through their own torch; a file needs neither
        torch nor safetensors. Returns the new weights version, the checksum, the tensor names and
        the bytes received.
        """
        return Call("PushWeights", push.push_requests(weights, chunk_bytes, on_progress), timeout,
                    PushResult.from_proto, serialized=True)

    @client_method
    def weights_checksum(self, *, timeout: float | None = None) -> Call[worker_pb2.GetWeightsChecksumResponse]:
        """The sha256 of the model's tensors as they are now, and the weights version."""
        return Call("GetWeightsChecksum", worker_pb2.GetWeightsChecksumRequest(), timeout)

    @client_method
    def load_adapter(self, name: str, path: str | Path, *, pin: bool = False, kind: str | int = "lora",
                     timeout: float | None = None) -> Call[common_pb2.AdapterInfo]:
        """Registers the adapter at ``path`` on the runner's filesystem as ``name``: a LoRA file (or a
        directory holding one), or with ``kind`` "controlnet" or "ip_adapter" a ControlNet or an
        IP-Adapter directory, which requests then name in ``controls`` or ``ip_adapter``.

        ``pin`` keeps it on the device: never evicted to make room for others.
        """
        return Call("LoadAdapter", worker_pb2.LoadAdapterRequest(name=name, path=str(path), pin=pin,
                                                                 kind=types.adapter_kind(kind)), timeout, _adapter)

    @client_method
    def unload_adapter(self, name: str, *, timeout: float | None = None) -> Call[None]:
        """Forgets adapter ``name`` on every runner (NOT_FOUND when it is not registered)."""
        return Call("UnloadAdapter", worker_pb2.UnloadAdapterRequest(name=name), timeout, _nothing)

    @client_method
    def list_adapters(self, *, timeout: float | None = None) -> Call[worker_pb2.ListAdaptersResponse]:
        """The registered adapters (resident or not, requests per adapter) and --max-adapters."""
        return Call("ListAdapters", worker_pb2.ListAdaptersRequest(), timeout)

    @client_method
    def health(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> Call[str]:
        """The health of ``service`` ("" for liveness): "SERVING", "NOT_SERVING", ..."""
        return Call("Check", health_pb2.HealthCheckRequest(service=service), timeout, types.health_name,
                    service="health")



class BlockingCalls(WorkerCalls[Events]):
    """The calls made blocking: ``DiffusionClient``'s base, whose ``_call`` returns the result."""


class AwaitedCalls(WorkerCalls[Events]):
    """The calls as coroutines: ``AsyncDiffusionClient``'s base, whose ``_call`` is a coroutine."""


def _was(response: worker_pb2.CancelResponse) -> str:
    return response.was


def _adapter(response: worker_pb2.LoadAdapterResponse) -> common_pb2.AdapterInfo:
    return response.adapter


def _nothing(response: object) -> None:
    return None
