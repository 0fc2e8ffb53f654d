"""Who may call what on the worker's public port, TLS for that port, and message size limits.

Tokens (``--ops-token-file``, ``--inference-token-file``) travel as ``authorization: Bearer``
metadata and are checked by ``serving_common.auth.BearerTokenInterceptor`` with the policy below:

- Ops RPCs (Init, Sleep, WakeUp, LoadWeights, AttachRunner, DetachRunner and any WorkerService
  method not listed as an inference RPC) accept only the ops token when one is configured.
- Inference RPCs (Generate, GenerateStream, GetStatus) accept the inference token or the ops
  token when an inference token is configured, and are open otherwise.
- Cancel: the worker has no client identity beyond the token, so the rule is per token. With an
  ops token configured, Cancel needs the ops token, or the inference token when one is
  configured (its holders are one client: they may cancel each other's requests). With neither,
  anyone may cancel any request id they know.
- With only an inference token, every WorkerService RPC needs it: ops RPCs are never left open
  while inference is guarded.

Health and reflection stay open for probes and ``grpcurl list`` (``serving_common.auth.OPEN_SERVICES``).
The OpenAI HTTP API asks the same policy object (``worker_token_policy``): its generations route
as Generate, its models route as GetStatus.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from serving_common.auth import BearerTokenInterceptor, TokenPolicy, read_token
from serving_common.protocol import WORKER_SERVICE
from worker_service.config import Limits, WorkerConfig

SERVICE_PREFIX = f"/{WORKER_SERVICE}/"
INFERENCE_METHODS = frozenset({"Generate", "GenerateStream", "GetStatus"})
CANCEL_METHOD = "Cancel"
# Room for the protobuf framing and the other fields of a GenerateResponse around the pixels.
RESPONSE_OVERHEAD_BYTES = 64 * 1024


class ConfigError(ValueError):
    """A flag combination the worker refuses to start with."""


def token_policy(ops_token: str | None, inference_token: str | None) -> TokenPolicy | None:
    """The policy described in the module docstring; None when no token is configured."""
    if not ops_token and not inference_token:
        return None
    inference = tuple(t for t in (inference_token, ops_token) if t)
    ops = (ops_token,) if ops_token else inference

    def policy(method: str) -> tuple[str, ...] | None:
        if not method.startswith(SERVICE_PREFIX):
            return ops  # any other service registered later is an ops surface
        name = method[len(SERVICE_PREFIX):]
        if name == CANCEL_METHOD:
            return inference if ops_token and inference_token else ops
        if name in INFERENCE_METHODS:
            return inference if inference_token else None
        return ops

    return policy


def worker_token_policy(config: WorkerConfig) -> TokenPolicy | None:
    """The worker's one policy, built once: the gRPC interceptor and the HTTP API both ask it."""
    return token_policy(read_token(config.ops_token_file), read_token(config.inference_token_file))


def auth_interceptors(policy: TokenPolicy | None) -> list[grpc.aio.ServerInterceptor]:
    return [BearerTokenInterceptor(policy)] if policy else []


def server_credentials(config: WorkerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the public port (mutual TLS with ``--tls-client-ca``), or None: plaintext."""
    if not (config.tls_cert or config.tls_key or config.tls_client_ca):
        return None
    if not (config.tls_cert and config.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def largest_response_bytes(limits: Limits) -> int:
    """The biggest GenerateResponse the bounds allow: max_images raw max_size x max_size RGB images."""
    return limits.max_size * limits.max_size * 3 * limits.max_images + RESPONSE_OVERHEAD_BYTES


def check_message_limit(max_message_bytes: int, limits: Limits) -> None:
    needed = largest_response_bytes(limits)
    if max_message_bytes < needed:
        raise ConfigError(
            f"--max-message-bytes {max_message_bytes} is too small for the largest response the bounds "
            f"allow ({limits.max_images} raw {limits.max_size}x{limits.max_size} images: {needed} bytes); "
            "raise it or lower --max-size / --max-images")
