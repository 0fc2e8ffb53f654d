"""``diffusion``: the command line of the worker.

    diffusion generate "a red fox" -o fox.png --seed 7
    diffusion status
    diffusion sleep --level 1 && diffusion wake
    diffusion health            # exit code 0 when SERVING, 1 otherwise

A failed call prints ``error: CODE: message`` and its field violations and exits 1; Ctrl-C
cancels the call in flight and exits 130.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from clients.client import DiffusionClient
from clients.types import DEFAULT_TARGET, OUTPUT_FORMATS, Done, Progress, Queued
from serving_common.errors import field_violations
from serving_common.flags import EnvDefaultsParser
from serving_common.protocol import DTYPES, WORKER_SERVICE

BAR_WIDTH = 30


def _progress(step: int, total: int) -> None:
    filled = BAR_WIDTH * step // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {step}/{total}")
    if step >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _output_paths(output: Path, count: int, extension: str) -> list[Path]:
    if not output.suffix:
        output = output.with_suffix(extension)
    if count == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(count)]


def cmd_generate(client: DiffusionClient, args: argparse.Namespace) -> int:
    stream = client.stream(
        args.prompt, negative_prompt=args.negative_prompt, width=args.width, height=args.height,
        steps=args.steps, guidance_scale=args.guidance, seed=args.seed, num_images=args.num_images,
        output_format=args.format)
    with stream:  # leaving early (Ctrl-C included) cancels the RPC
        result = None
        for event in stream:
            if isinstance(event, Queued) and event.position > 0:
                print(f"queued at position {event.position}", file=sys.stderr)
            elif isinstance(event, Progress):
                _progress(event.step, event.total)
            elif isinstance(event, Done):
                result = event.result
    if result is None or not result.images:
        print("error: the stream ended without images", file=sys.stderr)
        return 1
    paths = _output_paths(Path(args.output), len(result.images), result.images[0].extension)
    for path, image in zip(paths, result.images, strict=True):
        path.write_bytes(image.data)
        print(f"wrote {path} ({image.width}x{image.height}, seed {image.seed})")
    t = result.timings
    print(f"request {result.request_id}, model {result.model}, weights {result.weights_version or '-'}")
    print(f"timings: queue {t.queue_ms:.1f} ms, execute {t.execute_ms:.1f} ms, "
          f"encode {t.encode_ms:.1f} ms, total {t.total_ms:.1f} ms")
    return 0


def _print_json(message: Message) -> None:
    print(json_format.MessageToJson(message, always_print_fields_with_no_presence=True))


def cmd_status(client: DiffusionClient, args: argparse.Namespace) -> int:
    _print_json(client.status())
    return 0


def cmd_sleep(client: DiffusionClient, args: argparse.Namespace) -> int:
    _print_json(client.sleep(args.level, args.tags))
    return 0


def cmd_wake(client: DiffusionClient, args: argparse.Namespace) -> int:
    _print_json(client.wake(args.tags))
    return 0


def cmd_load_weights(client: DiffusionClient, args: argparse.Namespace) -> int:
    _print_json(client.load_weights(args.path))
    return 0


def cmd_init(client: DiffusionClient, args: argparse.Namespace) -> int:
    _print_json(client.init(args.model, args.dtype))
    return 0


def cmd_cancel(client: DiffusionClient, args: argparse.Namespace) -> int:
    print(f"cancelled {args.request_id} (was {client.cancel(args.request_id)})")
    return 0


def cmd_health(client: DiffusionClient, args: argparse.Namespace) -> int:
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="diffusion", description="Talk to a diffusion worker.",
                               env_prefix="DIFFUSION_")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="worker address: host:port or unix:/path")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each call in seconds")
    parser.add_argument("--token", default=None, help="bearer token sent with every call (the worker's ops or "
                        "inference token)")
    parser.add_argument("--tls-ca", default=None, help="PEM file of the CA that signed the worker's "
                        "certificate: connect with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=argparse.ArgumentParser)

    def command(name: str, handler: object, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.set_defaults(handler=handler)
        return p

    p = command("generate", cmd_generate, "generate images and write them to files")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True,
                   help="file to write; with several images NAME-0.EXT, NAME-1.EXT, ...")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--width", type=int, help="default: the worker's")
    p.add_argument("--height", type=int, help="default: the worker's")
    p.add_argument("--steps", type=int, help="denoising steps; default: the worker's")
    p.add_argument("--guidance", type=float, help="guidance scale; default: the worker's")
    p.add_argument("--seed", type=int, help="default: a random seed, printed")
    p.add_argument("--num-images", type=int, default=1)
    p.add_argument("--format", choices=sorted(OUTPUT_FORMATS), default="png",
                   help="raw writes height x width x 3 uint8 pixels")

    command("status", cmd_status, "print the worker's status as JSON")
    p = command("sleep", cmd_sleep, "put the model to sleep")
    p.add_argument("--level", type=int, default=1, help="1: offload weights to host memory, 2: discard them")
    p.add_argument("--tags", nargs="+", default=[], help="components to put to sleep; none means all")
    p = command("wake", cmd_wake, "wake the model up")
    p.add_argument("--tags", nargs="+", default=[], help="components to wake; none means all")
    p = command("load-weights", cmd_load_weights, "load safetensors weights from the runner's filesystem")
    p.add_argument("path")
    p = command("init", cmd_init, "load a model, or switch to another one")
    p.add_argument("model", help='a built-in name ("tiny", "small") or a model directory')
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p = command("cancel", cmd_cancel, "cancel a queued or running request")
    p.add_argument("request_id")
    p = command("health", cmd_health, "check health; exit code 0 when SERVING")
    p.add_argument("--service", default=WORKER_SERVICE, help='"" for liveness')
    return parser


def report_error(err: grpc.RpcError) -> None:
    code = err.code() if isinstance(err, grpc.Call) else None
    print(f"error: {code.name if code else 'UNKNOWN'}: {err.details() if code else err}", file=sys.stderr)
    if isinstance(err, grpc.Call):
        for field, description in field_violations(err).items():
            print(f"  {field}: {description}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with DiffusionClient(args.target, timeout=args.timeout, token=args.token, tls_ca=args.tls_ca,
                             tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            return args.handler(client, args)
    except grpc.RpcError as err:
        report_error(err)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
