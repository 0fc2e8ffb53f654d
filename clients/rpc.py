"""gRPC conventions shared by every side: the clients, the worker and the runner.

Everything here is torch-free, so the worker and the clients can use it.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Iterable, Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

# Sized for the largest image the default bounds allow (2048 x 2048 x 3 raw bytes, 4 images),
# well above gRPC's 4 MiB default, which a 1448 x 1448 RGB image already exceeds.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for channels and servers alike: explicit message size limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def bad_request(violations: Mapping[str, str] | Iterable[tuple[str, str]], message: str = "") -> grpc.Status:
    """An INVALID_ARGUMENT status carrying a ``google.rpc.BadRequest`` with one violation per field."""
    items = list(violations.items() if isinstance(violations, Mapping) else violations)
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                for field, description in items
            ]
        )
    )
    text = message or "; ".join(f"{field}: {description}" for field, description in items)
    return rpc_status.to_status(
        status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=text, details=[detail])
    )


def field_violations(error: grpc.Call) -> dict[str, str]:
    """Reads the ``BadRequest`` field violations of a failed call (empty when there are none)."""
    status = rpc_status.from_call(error)
    found: dict[str, str] = {}
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found.update({v.field: v.description for v in bad.field_violations})
    return found


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose every ``--flag`` can also come from ``PREFIX_FLAG`` in the environment.

    Command-line flags win over the environment, which wins over the built-in default; the help
    text names the variable of each flag.
    """

    def __init__(self, *args: object, env_prefix: str, **kwargs: object) -> None:
        self.env_prefix = env_prefix
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def add_argument(self, *names: str, **kwargs: object) -> argparse.Action:  # type: ignore[override]
        long_names = [n for n in names if n.startswith("--")]
        if long_names and kwargs.get("action") not in ("help", "version"):
            variable = self.env_prefix + long_names[0][2:].upper().replace("-", "_")
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]".strip()
            if variable in os.environ:
                kwargs["default"] = _from_env(os.environ[variable], kwargs)
                kwargs["required"] = False
        return super().add_argument(*names, **kwargs)


def _from_env(raw: str, kwargs: Mapping[str, object]) -> object:
    action = kwargs.get("action")
    if action == "store_true":
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    convert = kwargs.get("type")
    if not callable(convert):
        convert = str
    if action == "append":
        return [convert(part) for part in raw.split(",") if part]
    return convert(raw)


def create_server(
    listen: str,
    service_names: Iterable[str],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An asyncio gRPC server on ``listen`` with the standard health service and reflection.

    ``listen`` is ``host:port`` or ``unix:/path``; with ``credentials`` the port is TLS. The caller
    registers its servicers, starts
    the server and sets health statuses; every service starts NOT_SERVING but ``""``, which
    reports the process alive.
    """
    server = grpc.aio.server(options=channel_options(max_message_bytes), interceptors=list(interceptors))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen}")
    return server, health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def install_shutdown_signals(loop: object, on_signal: object) -> None:
    """Calls ``on_signal(signum)`` on SIGTERM and SIGINT, from the running asyncio loop."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)  # type: ignore[attr-defined]
