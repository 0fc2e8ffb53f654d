"""Limits and defaults of the worker, set from flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusion.v1 import common_pb2
from serving_common.channels import DEFAULT_MAX_MESSAGE_BYTES

# Encoded image inputs held by requests in progress, in all: a quarter of a 1 GiB pod.
DEFAULT_MAX_INPUT_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on the OpenAI HTTP port (``--http-port``), so that slow or idle clients can take
    neither the worker's file descriptors nor its memory (issue 20 item 2)."""

    # Connections open at once; one more is answered 503 and closed. Far below the usual file
    # descriptor limit, so gRPC keeps its own.
    max_connections: int = 256
    # Seconds a connection has to send a request's headers, from its start or the previous response.
    header_timeout: float = 10.0
    # Seconds a request has to send its whole body, from the end of its headers.
    body_timeout: float = 30.0
    # Bytes of request bodies being received or parsed, over all connections (each is at most
    # 1 MiB); a body past it is refused 429 before more of it is read.
    max_body_bytes_in_flight: int = 32 * 1024**2


@dataclass(frozen=True)
class Limits:
    """Bounds and defaults applied to every GenerateRequest."""

    min_size: int = 8
    max_size: int = 2048
    max_steps: int = 500
    max_images: int = 4
    max_prompt_chars: int = 2000
    max_request_id_chars: int = 128
    default_size: int = 64
    default_steps: int = 20
    default_guidance: float = 7.5
    # Beyond this, classifier-free guidance only saturates (3e38 gave an all-black image).
    max_guidance: float = 100.0
    # LoRA adapters of one request, and how far their scales go.
    max_request_adapters: int = 4
    max_adapter_scale: float = 10.0
    # Sleep and WakeUp tags: how many, and how long each.
    max_tags: int = 64
    max_tag_chars: int = 128


@dataclass(frozen=True)
class WorkerConfig:
    """Everything the worker is started with."""

    listen: str = "127.0.0.1:50051"
    runners: tuple[str, ...] = ("127.0.0.1:50052",)
    # Loaded with Init at start; empty means start without a model.
    model: str = "tiny"
    dtype: int = common_pb2.DTYPE_UNSPECIFIED
    auto_wake: bool = False
    max_queue: int = 64
    # Bytes of image inputs (encoded image and mask) that queued, decoding and running requests
    # hold in all; a request past it is refused RESOURCE_EXHAUSTED before anything is decoded.
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    # Generate and GenerateStream calls receiving their request message at once; the others wait,
    # their bytes held back at the client by HTTP/2 flow control. And the seconds a message may
    # take to arrive once its call has a slot.
    max_receiving_requests: int = 4
    receive_timeout: float = 30.0
    # Seconds given to queued and running requests to finish after SIGTERM.
    grace: float = 30.0
    limits: Limits = field(default_factory=Limits)
    # Dynamic batching: images per runner Execute (1: off), and how long the head of the queue
    # waits for compatible requests to fill a batch.
    max_batch_size: int = 4
    max_batch_delay_ms: float = 5.0
    # Which queued request runs next: "fifo", or "deadline" (the earliest deadline first).
    schedule: str = "fifo"
    # Seconds queued requests wait for a ready runner (one restarting, say) before UNAVAILABLE.
    max_runner_wait: float = 60.0
    # HTTP/2 keepalive on runner channels: a hung runner is unreachable after this plus 5 s (0: off).
    runner_keepalive: float = 10.0
    # An Execute with no progress for this long (or ten times its shape's last step time, when
    # longer) is given up: the runner is suspect and the batch is retried elsewhere.
    runner_stall_timeout: float = 60.0
    # Seconds between GetInfo polls of each runner (memory for metrics; state nobody asked for).
    runner_poll_interval: float = 5.0
    # Where the desired state (model, weight updates, sleep) is kept across worker restarts; "": nowhere.
    state_file: str = ""
    # PushWeights content kept for runners that restart: where ("": beside --state-file, else a
    # temporary directory), and how much in all.
    push_dir: str = ""
    max_pushed_bytes: int = 4 * 1024**3
    # Operations (issue 6): Prometheus port (0: off), tokens, TLS, message size, idle sleep.
    metrics_port: int = 9090
    # The OpenAI Images API over HTTP on the host of --listen (issue 15; 0: off).
    http_port: int = 8000
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    ops_token_file: str = ""
    inference_token_file: str = ""
    runner_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Seconds without requests after which the model is put to sleep; 0: never.
    sleep_after_idle: float = 0.0
    idle_sleep_level: int = 1
