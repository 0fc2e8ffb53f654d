"""Self-signed certificates for TLS tests, made with the openssl command line."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def self_signed(directory: Path, name: str, common_name: str = "localhost") -> tuple[Path, Path]:
    """(certificate, key) PEM files valid for localhost and 127.0.0.1; each is its own CA."""
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={common_name}",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    return cert, key


def wait_serving(process, credentials: grpc.ChannelCredentials, service: str = "", timeout: float = 60.0) -> None:
    """Like ServiceProcess.wait_healthy, over a TLS channel."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.process.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.process.returncode}:\n{process.log()}")
        with grpc.secure_channel(process.target, credentials) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=1.0).status
            except grpc.RpcError:
                status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} not SERVING over TLS after {timeout}s:\n{process.log()}")
