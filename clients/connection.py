"""How the sync and asyncio clients open their channel: plaintext or TLS (mutual TLS with a client
certificate), and the bearer token sent with every call. Shared by ``clients.client`` and
``clients.aio``; nothing here makes a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from clients.types import DEFAULT_TARGET
from diffusion.v1 import worker_pb2, worker_pb2_grpc
from serving_common.channels import message_options
from serving_common.deadlines import requested
from serving_common.protocol import WORKER_SERVICE

PemSource = str | Path | bytes | None


def _pem(source: PemSource) -> bytes | None:
    """PEM bytes as given, or read from a file path."""
    if source is None or source == "":
        return None
    if isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True)
class Connection:
    """A worker's address and how to reach it.

    ``token``: sent as ``authorization: Bearer <token>``. ``tls_ca``: PEM (bytes or a file path) of
    the CA that signed the worker's certificate; ``tls_cert`` and ``tls_key``: the client
    certificate for mutual TLS. Any of the three, or ``tls=True`` (system roots), makes the
    channel TLS.
    """

    target: str
    token: str | None = None
    tls: bool = False
    tls_ca: PemSource = None
    tls_cert: PemSource = None
    tls_key: PemSource = None

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.secure:
            return None
        cert, key = _pem(self.tls_cert), _pem(self.tls_key)
        if (cert is None) != (key is None):
            raise ValueError("tls_cert and tls_key go together")
        return grpc.ssl_channel_credentials(root_certificates=_pem(self.tls_ca), private_key=key,
                                            certificate_chain=cert)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def open(self, grpc_module: ModuleType = grpc) -> grpc.Channel | grpc.aio.Channel:
        """A channel from ``grpc`` (blocking) or ``grpc.aio``, with the shared message size limits."""
        credentials = self.credentials()
        channel: grpc.Channel | grpc.aio.Channel
        if credentials is None:
            channel = grpc_module.insecure_channel(self.target, options=message_options())
        else:
            channel = grpc_module.secure_channel(self.target, credentials, options=message_options())
        return channel


class ClientBase:
    """What the sync and asyncio clients share: the channel, the stubs and per-call options."""

    grpc_module: ModuleType = grpc  # grpc (blocking) or grpc.aio

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, token: str | None = None,
                 tls: bool = False, tls_ca: PemSource = None, tls_cert: PemSource = None,
                 tls_key: PemSource = None) -> None:
        """``timeout``: seconds, at most ``serving_common.deadlines.MAX_TIMEOUT_S`` (about three years:
        ``inf`` or more waits that long); ValueError for nan or a negative one. ``token``, ``tls*``: see
        ``Connection`` (TLS when any is given)."""
        self.target = target
        self.timeout = requested(timeout)
        connection = Connection(target, token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._metadata = connection.metadata
        self._channel = connection.open(self.grpc_module)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # The methods whose requests the clients serialize themselves (PushWeights': clients.push,
        # one copy of each chunk's data): the stub's method without protobuf's serializer.
        self._serialized: dict[str, Any] = {"PushWeights": self._channel.stream_unary(
            f"/{WORKER_SERVICE}/PushWeights", response_deserializer=worker_pb2.PushWeightsResponse.FromString)}

    def _options(self, timeout: float | None) -> dict[str, Any]:
        """Per-call keyword arguments: the deadline (clamped as the constructor's) and the token."""
        return {"timeout": self.timeout if timeout is None else requested(timeout), "metadata": self._metadata}
