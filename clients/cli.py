"""diffusion: the command line of a diffusion worker.

    diffusion generate "a red fox" -o fox.png --seed 7
    diffusion generate-video "a fox running" -o fox.mp4 --frames 17 --fps 8   # on a video model
    diffusion status
    diffusion requests          # the requests queued or running now
    diffusion cancel REQUEST_ID
    diffusion sleep --level 1 && diffusion wake
    diffusion health            # exit code 0 when SERVING, 1 otherwise
    diffusion adapters load style /models/style.safetensors && diffusion adapters list
    diffusion generate "a red fox" -o fox.png --adapter style:0.8
    diffusion adapters load edges /models/canny-controlnet --kind controlnet
    diffusion generate "a red fox" -o fox.png --control edges=edges.png:0.8   # docs/conditioning.md
    diffusion generate "a red fox in the snow" -o snowy.png --image fox.png --strength 0.6
    diffusion push-weights unet-update.safetensors && diffusion checksum
    diffusion serve org/name    # serve a model here: a runner and a worker, Ctrl-C stops both

A failed call prints "error: CODE: message" (and the fields at fault) and exits 1; Ctrl-C
cancels the call in flight and exits 130. Bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from clients.cli_conditioning import add_conditioning_flags, conditioning_options
from clients.client import DiffusionClient, EventStream
from clients.errors import DeadlineExceeded, DiffusionError, InvalidArgument
from clients.model_catalog import catalog, human_size
from clients.status_summary import status_summary
from clients.types import (
    DEFAULT_TARGET,
    IMAGE_FORMATS,
    RESIZE_MODES,
    TASKS,
    VIDEO_FORMATS,
    Done,
    GenerateResult,
    Progress,
    Queued,
    Started,
)
from diffusion.v1 import common_pb2, worker_pb2
from serving_common import pod
from serving_common.conditioning_rules import KIND_NAMES, KINDS
from serving_common.deadlines import requested
from serving_common.flags import DefaultsHelpFormatter, EnvDefaultsParser, StrictParser
from serving_common.generation_params import GenerationParams, Kind, Surface
from serving_common.input_rules import CACHE_METHODS, MAX_PARTIAL_IMAGES, MAX_SEED, VIDEO_TASKS
from serving_common.load_extras import parse_component, parse_fused
from serving_common.protocol import BUILTIN_MODEL_NAMES, DTYPES, WORKER_SERVICE
from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES

BAR_WIDTH = 30


class _Stderr:
    """stderr with a progress bar that other messages never land on: they start a new line.

    On a terminal the bar is redrawn in place; elsewhere (a log file, a pipe) it is printed as a
    line at the first step, each tenth of the way and the last step, never a redraw per step.
    """

    def __init__(self) -> None:
        self.bar_open = False
        self._last = ("", 0, -1)  # the label, step and tenth of the last line printed, off a terminal

    def progress(self, step: int, total: int, label: str = "") -> None:
        """Draws the bar of ``step`` of ``total``, after ``label`` (a video's phase: each has a bar)."""
        filled = BAR_WIDTH * min(step, total) // max(total, 1)
        bar = f"{label}{' ' if label else ''}[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {step}/{total}"
        if not sys.stderr.isatty():
            tenth = 10 * min(step, total) // max(total, 1)
            last_label, last_step, last_tenth = self._last
            if label != last_label or step < last_step or tenth != last_tenth:  # a new bar, or a tenth further
                print(bar, file=sys.stderr, flush=True)
                self._last = (label, step, tenth)
            return
        sys.stderr.write(f"\r{bar}")
        self.bar_open = step < total
        if not self.bar_open:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def end_line(self) -> None:
        if self.bar_open:
            sys.stderr.write("\n")
            self.bar_open = False

    def say(self, text: str) -> None:
        self.end_line()
        print(text, file=sys.stderr, flush=True)


stderr = _Stderr()
# `init`'s flags for InitRequest.acceleration: one for each of its fields, the argparse name the field's.
ACCELERATION_OPTIONS = tuple(field.name for field in common_pb2.Acceleration.DESCRIPTOR.fields)
# `init`'s flags for InitRequest.parallel: the argparse name of each of its fields.
PARALLEL_OPTIONS = {"cfg": "cfg_parallel", "ulysses_degree": "ulysses_degree", "ring_degree": "ring_degree"}


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, not {value}")
        return value

    return parse


T = TypeVar("T")


def _flag_value(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type: its ValueError is the flag's usage error."""
    def flag_value(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return flag_value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _image_file(text: str) -> bytes:
    """The contents of an image file (the worker checks that it is a PNG, JPEG or WebP)."""
    try:
        return Path(text).read_bytes()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {error.strerror or error}") from None


def _size(text: str) -> tuple[int, int]:
    """WIDTHxHEIGHT, both whole numbers of at least 1."""
    width, x, height = text.lower().partition("x")
    if not (x and width.isdigit() and height.isdigit() and int(width) >= 1 and int(height) >= 1):
        raise argparse.ArgumentTypeError(f"must be WIDTHxHEIGHT in pixels, like 32x32, not {text!r}")
    return int(width), int(height)


def _add_size_flags(p: argparse.ArgumentParser, default: str) -> None:
    """The size flags of generate and generate-video: --width and --height, or --size for both (``chosen_size``),
    and --resize to fit an --image of another size."""
    at_least_1 = _integer(1)
    grid = "a multiple of the model's size_multiple (diffusion status: sizes)"
    p.add_argument("--width", type=at_least_1, help=f"pixels, {grid}; default: {default}")
    p.add_argument("--height", type=at_least_1, help=f"pixels, {grid}; default: {default}")
    p.add_argument("--size", type=_size, metavar="WxH", help="--width and --height in one, like 64x48")
    p.add_argument("--resize", choices=sorted(RESIZE_MODES),
                   help="fit an --image of another size than the one asked for (default: refuse it)")


def chosen_size(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The width and height asked for (None: the default), from --size or --width and --height;
    ValueError when both forms are given."""
    if args.size is None:
        return args.width, args.height
    if args.width is not None or args.height is not None:
        raise ValueError(f"--size {args.size[0]}x{args.size[1]} and --width/--height both give the size: use one")
    width, height = args.size
    return width, height


def _adapter(text: str) -> tuple[str, float]:
    """NAME or NAME:SCALE (scale 1 when left out)."""
    name, colon, scale = text.partition(":")
    refusal = argparse.ArgumentTypeError(f"must be NAME or NAME:SCALE with a finite number SCALE, not {text!r}")
    try:
        value = float(scale) if colon else 1.0
    except ValueError:
        raise refusal from None
    if not name or not math.isfinite(value):
        raise refusal
    return name, value


# The format each file name extension names (-o), as --format spells it: generate's, the first the
# default, and generate-video's.
EXTENSION_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp", ".raw": "raw"}
VIDEO_EXTENSION_FORMATS = {".mp4": "mp4", ".webp": "webp", ".raw": "raw"}


def output_format(output: Path, chosen: str | None, extensions: dict[str, str] = EXTENSION_FORMATS,
                  kind: str = "image") -> str:
    """The format to ask the worker for: ``--format``, else the one ``-o``'s extension names (the
    first of ``extensions`` for a name without one). ValueError when the two disagree, or the
    extension names no ``kind`` format."""
    named = extensions.get(output.suffix.lower())
    if chosen is None:
        if output.suffix and named is None:
            raise ValueError(f"-o {output}: {output.suffix} names no {kind} format; use "
                             f"{', '.join(extensions)} or give --format")
        return named or next(iter(extensions.values()))
    if named is not None and named != chosen:
        raise ValueError(f"-o {output} names {named}, but --format is {chosen}")
    return chosen


def _output_paths(output: Path, count: int, extension: str) -> list[Path]:
    if not output.suffix:
        output = output.with_suffix(extension)
    if count == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(count)]


def _follow(stream: EventStream, phases: bool,
            on_previews: Callable[[Progress], None] | None = None) -> GenerateResult | None:
    """A stream's result, its queue position, start and progress bars on stderr meanwhile (``phases``:
    a bar per phase, named, for a video's denoising, decoding and encoding); ``on_previews`` gets
    each progress event that brings previews."""
    with stream:  # leaving early (Ctrl-C included) cancels the RPC
        result = None
        for event in stream:
            if isinstance(event, Queued) and event.position > 0:
                stderr.say(f"request {event.request_id} queued at position {event.position}")
            elif isinstance(event, Started):  # again when the worker retries it on another runner
                stderr.say(f"request {event.request_id} started")
            elif isinstance(event, Progress):
                stderr.progress(event.step, event.total, event.phase if phases else "")
                if event.previews and on_previews is not None:
                    on_previews(event)
            elif isinstance(event, Done):
                result = event.result
    stderr.end_line()
    return result


def _print_request(result: GenerateResult, verbose: bool = False) -> None:
    t = result.timings
    print(f"request {result.request_id}, model {result.model}, weights {result.weights_version or '-'}")
    print(f"timings: queue {t.queue_ms:.1f} ms, execute {t.execute_ms:.1f} ms, "
          f"encode {t.encode_ms:.1f} ms, total {t.total_ms:.1f} ms")
    if verbose:
        print(f"phases: text encode {t.text_encode_ms:.1f} ms, denoise {t.denoise_ms:.1f} ms, "
              f"decode {t.decode_ms:.1f} ms, to host {t.to_host_ms:.1f} ms, transfer {t.transfer_ms:.1f} ms")


def _preview_writer(directory: Path, output: Path) -> Callable[[Progress], None]:
    """Writes each preview of a progress event into ``directory``, named after ``output``:
    NAME-partialK.EXT (NAME-I-partialK.EXT with several images)."""
    directory.mkdir(parents=True, exist_ok=True)

    def write(event: Progress) -> None:
        base = directory / f"{output.stem}-partial{event.partial_image_index}"
        for path, image in zip(_output_paths(base, len(event.previews), event.previews[0].extension),
                               event.previews, strict=True):
            path.write_bytes(image.data)
            stderr.say(f"wrote preview {path} ({image.width}x{image.height}, step {event.step} of {event.total})")
    return write


# How the CLI reads a declared field's value (``GenerationParams``' Surface), by its kind.
_KIND_TYPES: dict[Kind, Callable[[str], object]] = {
    Kind.TEXT: str, Kind.COUNT: _integer(1), Kind.SEED: _integer(0, MAX_SEED), Kind.SCALE: _non_negative_float}


def _declared_surfaces(video: bool) -> list[Surface]:
    """The fields a generate command takes as flags of their own: every one declared with a Surface
    (only those a video takes, for generate-video)."""
    return [surface for _, surface in GenerationParams.surfaces() if surface.video or not video]


def _add_declared_flags(p: argparse.ArgumentParser, video: bool) -> None:
    for surface in _declared_surfaces(video):
        p.add_argument(surface.flag, dest=surface.keyword, type=_KIND_TYPES[surface.kind],
                       default="" if surface.kind is Kind.TEXT else None, help=surface.help)


def _declared_values(args: argparse.Namespace, video: bool) -> dict[str, Any]:
    """The client keywords of the declared fields, as the flags gave them (None: unset)."""
    return {surface.keyword: getattr(args, surface.keyword) for surface in _declared_surfaces(video)}


def cmd_generate(client: DiffusionClient, args: argparse.Namespace) -> int:
    if args.wait:
        stderr.say(f"waiting for the worker at {client.target} to be ready")
        awaited, args.awaited = args.awaited, "the worker at {target} to be ready"
        client.wait_ready()
        args.awaited = awaited
    result = _follow(client.stream(
        args.prompt, width=args.width, height=args.height, **_declared_values(args, video=False),
        output_format=args.format, adapters=args.adapter, image=args.image, mask=args.mask,
        strength=args.strength, task=args.task or 0, resize_mode=args.resize or 0,
        partial_images=args.partial_images if args.previews else 0, **args.conditioning), phases=False,
        on_previews=_preview_writer(args.previews, Path(args.output)) if args.previews else None)
    if result is None or not result.images:
        stderr.say("error: the stream ended without images")
        return 1
    paths = _output_paths(Path(args.output), len(result.images), result.images[0].extension)
    for path, image in zip(paths, result.images, strict=True):
        path.write_bytes(image.data)
        print(f"wrote {path} ({image.width}x{image.height}, seed {image.seed})")
    _print_request(result, args.verbose)
    return 0


def cmd_generate_video(client: DiffusionClient, args: argparse.Namespace) -> int:
    result = _follow(client.stream_video(
        args.prompt, num_frames=args.frames, fps=args.fps, width=args.width, height=args.height,
        **_declared_values(args, video=True), image=args.image, resize_mode=args.resize or 0,
        output_format=args.format, return_frames=False),
        phases=True)
    if result is None:
        stderr.say("error: the stream ended without its result")
        return 1
    video = result.video()
    [path] = _output_paths(Path(args.output), 1, video.extension)
    path.write_bytes(video.data)
    print(f"wrote {path} ({video.num_frames} frames of {video.width}x{video.height} at {video.fps} fps, "
          f"seed {video.seed})")
    _print_request(result)
    return 0


def _print_json(message: Message) -> None:
    print(json_format.MessageToJson(message, always_print_fields_with_no_presence=True))


def cmd_status(client: DiffusionClient, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        _print_json(status)
    else:
        print(status_summary(status))
    return 0


def _age(ms: float) -> str:
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns, two spaces apart; the first row is the heading."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def requests_table(active: Sequence[worker_pb2.ActiveRequest]) -> str:
    """The worker's active requests as a small table: id, state, queue position, steps, age."""
    if not active:
        return "no active requests"
    rows = [("REQUEST", "STATE", "POSITION", "STEP", "AGE")]
    for r in active:
        rows.append((r.request_id, r.state, str(r.position) if r.state == "queued" else "-",
                     f"{r.step}/{r.total_steps}" if r.total_steps else "-", _age(r.age_ms)))
    return _table(rows)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def adapters_table(adapters: Sequence[common_pb2.AdapterInfo]) -> str:
    """The registered adapters as a small table: name, kind, resident, pinned, components, requests, path."""
    if not adapters:
        return "no adapters"
    rows = [("NAME", "KIND", "RESIDENT", "PINNED", "COMPONENTS", "REQUESTS", "PATH")]
    for a in adapters:
        rows.append((a.name, KIND_NAMES.get(a.kind, str(a.kind)), _yes(a.resident), _yes(a.pinned),
                     ",".join(a.components) or "-", str(a.requests), a.path))
    return _table(rows)


def cmd_requests(client: DiffusionClient, args: argparse.Namespace) -> int:
    print(requests_table(client.status().active_requests))
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


def cmd_push_weights(client: DiffusionClient, args: argparse.Namespace) -> int:
    reply = client.push_weights(args.path, chunk_bytes=args.chunk_bytes, on_progress=stderr.progress)
    stderr.end_line()
    print(f"pushed {len(reply.loaded_names)} tensors ({reply.bytes_received} bytes): "
          f"weights version {reply.weights_version}, checksum {reply.checksum}")
    return 0


def cmd_checksum(client: DiffusionClient, args: argparse.Namespace) -> int:
    reply = client.weights_checksum()
    print(f"checksum {reply.checksum}, weights version {reply.weights_version or '-'}")
    return 0


def cmd_adapters_load(client: DiffusionClient, args: argparse.Namespace) -> int:
    adapter = client.load_adapter(args.name, args.path, pin=args.pin, kind=args.kind)
    print(f"loaded {'adapter' if args.kind == 'lora' else args.kind} {adapter.name} ({', '.join(adapter.components)}"
          f"{', pinned' if adapter.pinned else ''}) from {adapter.path}")
    return 0


def cmd_adapters_unload(client: DiffusionClient, args: argparse.Namespace) -> int:
    client.unload_adapter(args.name)
    print(f"unloaded adapter {args.name}")
    return 0


def cmd_adapters_list(client: DiffusionClient, args: argparse.Namespace) -> int:
    reply = client.list_adapters()
    print(adapters_table(reply.adapters))
    print(f"at most {reply.max_adapters} resident at once")
    return 0


def cmd_init(client: DiffusionClient, args: argparse.Namespace) -> int:
    acceleration = {name: getattr(args, name) for name in ACCELERATION_OPTIONS if getattr(args, name)}
    parallel = {field: getattr(args, name) for field, name in PARALLEL_OPTIONS.items() if getattr(args, name)}
    _print_json(client.init(args.model, args.dtype, acceleration=acceleration, parallel=parallel,
                            component_overrides=args.component, fused_adapters=args.fuse_lora))
    return 0


def cmd_cancel(client: DiffusionClient, args: argparse.Namespace) -> int:
    print(f"cancelled {args.request_id} (was {client.cancel(args.request_id)})")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Lists the models this machine holds (``clients.model_catalog``); no worker is called."""
    entries, notes = catalog(args.model_root)
    if args.json:
        print(json.dumps([entry.__dict__ for entry in entries], indent=1))
    else:
        print(_table([("NAME", "KIND", "PIPELINE", "SIZE", "PATH"),
                      *((e.name, e.kind, e.pipeline or "-", human_size(e.size), e.path or "-") for e in entries)]))
    for note in notes:
        stderr.say(f"note: {note}")
    return 0


def cmd_health(client: DiffusionClient, args: argparse.Namespace) -> int:
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """Descriptions as written (the examples keep their lines), defaults shown."""


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="diffusion", description=__doc__, env_prefix="DIFFUSION_",
                               formatter_class=_HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="worker address: host:port or unix:/path")
    timeout_help = "deadline of each call in seconds (inf: none; at most about three years)"
    parser.add_argument("--timeout", type=float, default=None, help=timeout_help)
    parser.add_argument("--token", default=None, help="bearer token sent with every call (the worker's ops or "
                        "inference token)")
    parser.add_argument("--tls-ca", default=None, help="PEM file of the CA that signed the worker's "
                        "certificate: connect with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=StrictParser)
    # --timeout after the command too; unset there, the one before it (or DIFFUSION_TIMEOUT) counts.
    after = StrictParser(add_help=False)
    after.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help=timeout_help)

    def command(name: str, handler: object, help: str, description: str = "", rpc: str = "",
                commands: argparse._SubParsersAction[StrictParser] = sub) -> argparse.ArgumentParser:
        """A subcommand; ``rpc``: the call it waits for, which a timeout names (``awaited``)."""
        p = commands.add_parser(name, help=help, description=description or help, parents=[after])
        p.set_defaults(handler=handler, awaited=f"the worker at {{target}} to answer {rpc}")
        return p

    at_least_1 = _integer(1)
    p = command("generate", cmd_generate, "generate images and write them to files",
                "Generate images and write them to files. The request id is printed on stderr when it "
                "starts (for diffusion cancel), then a progress bar.")
    p.set_defaults(awaited="the images from the worker at {target}")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True,
                   help="file to write, its extension naming the format (.png, .jpg, .webp, .raw; none: "
                   ".png added); with several images NAME-0.EXT, NAME-1.EXT, ...")
    _add_size_flags(p, "the worker's, or the --image's size")
    _add_declared_flags(p, video=False)
    p.add_argument("--format", choices=IMAGE_FORMATS,
                   help="image format, if -o's extension does not say it; raw writes height x width x 3 "
                   "uint8 pixels")
    p.add_argument("--adapter", type=_adapter, action="append", default=[], metavar="NAME[:SCALE]",
                   help="a LoRA adapter registered with 'adapters load', at SCALE (default 1); repeatable")
    p.add_argument("--image", type=_image_file, metavar="FILE",
                   help="input image (PNG, JPEG or WebP): image-to-image, or the image an edit model edits; "
                   "unset --width/--height take its size")
    p.add_argument("--mask", type=_image_file, metavar="FILE",
                   help="inpainting mask of the image's size: white is repainted, black kept")
    p.add_argument("--strength", type=_non_negative_float,
                   help="how far from the image to go, in (0, 1]; default 0.8 (runs steps x strength steps)")
    p.add_argument("--task", choices=sorted(name for name, task in TASKS.items() if task not in VIDEO_TASKS),
                   help="default: follows from --image and --mask")
    add_conditioning_flags(p)
    p.add_argument("--wait", action="store_true",
                   help="first wait until the worker is ready (listening, its model loaded), within --timeout "
                   "when given, instead of failing UNAVAILABLE while it starts")
    p.add_argument("--previews", type=Path, metavar="DIR",
                   help="write previews of each image while it is denoised into DIR (made if missing), as "
                   "OUTPUT-partialK.EXT: small pictures of the latents, on models whose family has a preview map")
    p.add_argument("--partial-images", type=_integer(1, MAX_PARTIAL_IMAGES), default=MAX_PARTIAL_IMAGES,
                   metavar="N", help="with --previews: how many previews of each image, at evenly spaced steps")
    p.add_argument("--verbose", action="store_true",
                   help="also print where the time went: the runner's phases and the transfer (docs/metrics.md)")

    p = command("generate-video", cmd_generate_video, "generate a video and write it to a file",
                "Generate a video on a video model (text-to-video, or image-to-video from --image) and write "
                "its container to a file. The request id is printed on stderr when it starts (for diffusion "
                "cancel), then a progress bar for each phase: denoising, decoding (the VAE) and encoding.")
    p.set_defaults(awaited="the video from the worker at {target}")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True,
                   help="file to write, its extension naming the format (.mp4, .webp: animated, .raw: frames x "
                   "height x width x 3 uint8 pixels; none: .mp4 added)")
    p.add_argument("--frames", type=at_least_1,
                   help="frames, on the model's grid (diffusion status: video, e.g. 4k+1); default: the model's")
    p.add_argument("--fps", type=at_least_1, help="frames per second, in the model's range; default: the model's")
    _add_size_flags(p, "the model's, or the --image's size; even numbers for MP4")
    _add_declared_flags(p, video=True)
    p.add_argument("--image", type=_image_file, metavar="FILE",
                   help="the first frame (PNG, JPEG or WebP): image-to-video, on a model that serves it")
    p.add_argument("--format", choices=VIDEO_FORMATS, help="video format, if -o's extension does not say it")

    p = command("status", cmd_status, "print the worker's status: a summary, or the whole of it as JSON",
                "Print the worker's state, model, sleep, runners and their devices, queue, acceleration and "
                "parallel plan in a few lines; --json prints the whole GetStatus response.", rpc="GetStatus")
    p.add_argument("--json", action="store_true", help="the whole GetStatus response as JSON")
    command("requests", cmd_requests, "list the requests queued or running on the worker",
            "List the requests the worker holds now (queued, running or encoding): id, state, queue "
            "position, steps done and age.", rpc="GetStatus")
    p = command("sleep", cmd_sleep, "put the model to sleep", rpc="Sleep")
    p.add_argument("--level", type=int, choices=[1, 2], default=1,
                   help="1: offload weights to host memory, 2: discard them")
    p.add_argument("--tags", nargs="+", default=[], help="components to put to sleep; none means all")
    p = command("wake", cmd_wake, "wake the model up", rpc="WakeUp")
    p.add_argument("--tags", nargs="+", default=[], help="components to wake; none means all")
    p = command("load-weights", cmd_load_weights, "load safetensors weights from the runner's filesystem",
                "Load safetensors weights into the model, all or nothing. Tensor names are "
                "<component>.<param>: the pipeline component, then the parameter or buffer name inside "
                "it, e.g. unet.conv_in.weight or text_encoder.text_model.final_layer_norm.bias. Every "
                "name, shape and dtype must match the model.", rpc="LoadWeights")
    p.add_argument("path", help="a .safetensors file, or a directory of them, on the runner's filesystem")
    p = command("push-weights", cmd_push_weights, "stream a local safetensors file to the worker",
                "Stream the tensors of a .safetensors file on this machine to the worker, which applies them "
                "on every runner, all or nothing, once their sha256 checks out; a progress bar, then the "
                "new weights version and checksum. Tensor names as for load-weights. Needs torch and "
                "safetensors.", rpc="PushWeights")
    p.add_argument("path", help="a .safetensors file on this machine")
    p.add_argument("--chunk-bytes", type=at_least_1, default=DEFAULT_CHUNK_BYTES, help="data per message")
    command("checksum", cmd_checksum, "print the sha256 of the model's tensors and the weights version",
            rpc="GetWeightsChecksum")
    adapters = sub.add_parser("adapters", help="load, unload and list LoRA adapters, ControlNets and IP-Adapters",
                              description="LoRA adapters, ControlNets and IP-Adapters, registered on every runner; "
                                          "generate --adapter NAME[:SCALE], --control NAME=IMAGE[:SCALE] and "
                                          "--ip-adapter NAME=IMAGE[:SCALE] use them per request.")
    adapter_commands = adapters.add_subparsers(dest="adapters_command", required=True, metavar="ACTION")
    p = command("load", cmd_adapters_load, "register a LoRA, ControlNet or IP-Adapter from the runner's filesystem",
                rpc="LoadAdapter", commands=adapter_commands)
    p.add_argument("name", help="1 to 64 letters, digits, '-' or '_'")
    p.add_argument("path", help="a .safetensors LoRA file (diffusers, kohya-ss or peft names), or a directory "
                   "holding one; with --kind, a ControlNet or IP-Adapter directory; on the runner's filesystem")
    p.add_argument("--pin", action="store_true", help="never evict it to make room for others")
    p.add_argument("--kind", choices=sorted(KINDS), default="lora",
                   help="what it is: a LoRA (--adapter), a ControlNet (--control) or an IP-Adapter (--ip-adapter)")
    p = command("unload", cmd_adapters_unload, "unregister an adapter", rpc="UnloadAdapter",
                commands=adapter_commands)
    p.add_argument("name")
    command("list", cmd_adapters_list, "list the adapters: resident, pinned, components, requests, path",
            rpc="ListAdapters", commands=adapter_commands)
    p = command("init", cmd_init, "load a model, or switch to another one", rpc="Init")
    p.add_argument("model", help=f"a built-in model ({', '.join(BUILTIN_MODEL_NAMES)}), a model directory on "
                   "the runner's filesystem, or a Hugging Face id org/name[@revision] in its hub cache "
                   "(docs/models.md; diffusion models lists them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--component", action="append", default=[], type=_flag_value(parse_component),
                   metavar="NAME=SOURCE", help="take the model's component NAME (vae, text_encoder, unet...) from "
                   "SOURCE (a directory, Hugging Face id or single file on the runner); repeatable")
    p.add_argument("--fuse-lora", action="append", default=[], type=_flag_value(parse_fused),
                   metavar="PATH[:SCALE]", help="fuse a LoRA into the model's weights at load (Lightning, Hyper-SD, "
                   "LCM), at SCALE (default 1.0); repeatable")
    acceleration = p.add_argument_group(
        "acceleration (docs/acceleration.md; the model's info lists what it is offered)")
    acceleration.add_argument("--cache", help=f"step cache: {', '.join(CACHE_METHODS)}")
    acceleration.add_argument("--cache-threshold", type=_non_negative_float,
                              help="the step cache's threshold; unset: the method's default "
                              "(docs/acceleration.md); higher skips more")
    acceleration.add_argument("--cache-warmup-steps", type=_integer(0),
                              help="steps at the start of every image that run the whole denoiser")
    acceleration.add_argument("--compile", action="store_true", help="compile the denoiser's repeated blocks")
    acceleration.add_argument("--quantization", help="weight quantization: int8-weight-only, float8-weight-only")
    acceleration.add_argument("--attention-backend", help="attention backend of diffusers' dispatcher: native, ...")
    parallel = p.add_argument_group(
        "parallelism (a runner of several devices spreads each request over them; the runner says what it can take)")
    parallel.add_argument("--cfg-parallel", action="store_true",
                          help="the two branches of classifier-free guidance on two devices at once")
    parallel.add_argument("--ulysses-degree", type=_integer(0),
                          help="context parallelism: devices the sequence is split over by Ulysses")
    parallel.add_argument("--ring-degree", type=_integer(0),
                          help="context parallelism: devices the sequence is split over by ring attention")
    p = command("cancel", cmd_cancel, "cancel a queued or running request",
                "Cancel a queued or running request by id (printed by generate, listed by requests).", rpc="Cancel")
    p.add_argument("request_id")
    p = command("health", cmd_health, "check health; exit code 0 when SERVING", rpc="Health/Check")
    p.add_argument("--service", default=WORKER_SERVICE, help='"" for liveness')
    p = sub.add_parser("models", help="list the models this machine can serve, by the name --model takes",
                       description="List the models on THIS machine (run it where the runner runs; no worker is "
                       "called):\nthe built-ins, the Hugging Face cache's diffusers pipelines (HF_HUB_CACHE, by "
                       "default\n$HF_HOME/hub; size on disk and pipeline class) and the pipelines in each "
                       "--model-root.\nSee docs/models.md.", formatter_class=_HelpFormatter)
    roots = [Path(root) for root in os.environ.get("DIFFUSION_RUNNER_MODEL_ROOT", "").split(",") if root]
    p.add_argument("--model-root", type=Path, action="append", default=roots,
                   help="a runner's model root to list (repeatable) [env DIFFUSION_RUNNER_MODEL_ROOT]")
    p.add_argument("--json", action="store_true", help="a JSON list instead, one object per model")
    p = sub.add_parser("serve", help="serve a model on this machine: a runner and a worker, as make run starts them",
                       description="Serve MODEL on this machine: a runner and a worker, what make run starts,\n"
                       "their output prefixed [runner] and [worker]. Ctrl-C stops both and exits 0; a model\n"
                       "that cannot load exits 1 with the reason. Flags after -- go to the worker\n"
                       "(diffusion-worker --help): diffusion serve tiny -- --served-model-name my-model",
                       formatter_class=_HelpFormatter)
    p.add_argument("model", help=f"a built-in model ({', '.join(BUILTIN_MODEL_NAMES)}), a model directory, or a "
                   "Hugging Face id org/name[@revision] in the hub cache (docs/models.md; diffusion models lists them)")
    pod.add_arguments(p)
    return parser


def report_error(err: DiffusionError) -> None:
    """One line "error: CODE: message", then each field violation the message does not already say."""
    stderr.say(f"error: {err}")
    for field, description in (err.violations if isinstance(err, InvalidArgument) else {}).items():
        if f"{field}: {description}" not in err.message:
            stderr.say(f"  {field}: {description}")


def timed_out(err: DeadlineExceeded, timeout: float | None, awaited: str) -> str:
    """What a deadline stopped: "DEADLINE_EXCEEDED: timed out after 30 s waiting for ``awaited``", and
    what the worker said when it was the worker that ended the call (gRPC's own words say nothing more)."""
    after = f" after {timeout:g} s" if timeout is not None else ""
    said = f" ({err.message})" if err.message and err.message != "Deadline Exceeded" else ""
    return f"{err.code().name}: timed out{after} waiting for {awaited}{said}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    own, worker_flags = pod.split_worker_flags(given) if given[:1] == ["serve"] else (given, [])
    args = parser.parse_args(own)
    if args.command == "models":  # no client: it lists this machine's files
        return cmd_models(args)
    if args.command == "serve":  # no client: this starts the worker
        return pod.run(args, worker_flags, pod.SERVE)
    try:
        requested(args.timeout, "--timeout")
    except ValueError as error:
        parser.error(str(error))
    if args.handler in (cmd_generate, cmd_generate_video):
        video = args.handler is cmd_generate_video
        try:
            args.format = output_format(Path(args.output), args.format,
                                        VIDEO_EXTENSION_FORMATS if video else EXTENSION_FORMATS,
                                        "video" if video else "image")
            args.width, args.height = chosen_size(args)
            args.conditioning = {} if video else conditioning_options(args.control, args.ip_adapter)
        except ValueError as error:
            parser.error(str(error))
    try:
        with DiffusionClient(args.target, timeout=args.timeout, token=args.token, tls_ca=args.tls_ca,
                             tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            return int(args.handler(client, args))
    except DeadlineExceeded as err:
        stderr.say(f"error: {timed_out(err, args.timeout, args.awaited.format(target=args.target))}")
        return 1
    except DiffusionError as err:
        report_error(err)
        return 1
    except (OSError, ValueError, ImportError) as err:  # an unreadable file, a bad PEM pair, no torch to push with
        stderr.say(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        stderr.bar_open = False
        print("\ncancelled", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
