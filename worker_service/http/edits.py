"""The body of ``POST /v1/images/edits`` as the GenerateRequest it stands for.

The OpenAI SDK's ``images.edit`` sends multipart/form-data: the files ``image`` (required) and
``mask`` (inpainting; without it image-to-image), and every other field, ``extra_body``'s too, as
text. The text fields are those of a generation, read by ``params.parse_generation`` once their
numbers are numbers again (an empty one, which the SDK sends for None, is absent), plus two
extensions of edits: ``strength`` and ``resize_mode`` (``resize`` or ``crop``, for an image of
another size than ``size``). ``controls`` and ``ip_adapter`` are text fields holding the JSON a
generation's body gives them (``conditioning``).

The mask follows OpenAI's convention, transparent (alpha 0) where the image is to be repainted;
it becomes this worker's (white: repaint) with ``image_inputs.mask_from_alpha``. The image and
mask then take a gRPC Generate's path: ``--max-input-bytes`` admission, ``--max-size`` decode
bounds, a mask of another size than the image refused naming ``mask``.

The body is bounded before it is parsed: at most ``--http-max-body-bytes-in-flight`` in all
(413 past it), counted against that budget with every other body until the GenerateRequest is
built (429 when other bodies hold it), at most ``MAX_FILES`` files and ``MAX_FIELDS`` fields,
each field at most ``MAX_BODY_BYTES``; files are kept in memory, never spooled to disk
(``reading_form``, which the Videos API's multipart creates go through too). A text part must be
valid UTF-8 (or the charset the body declares): Starlette would decode it as Latin-1 instead,
silently other characters; and its numbers are ASCII decimal (``params.decimal_int``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from diffusion.v1 import worker_pb2
from serving_common.errors import ServiceError, invalid_argument
from serving_common.generation_params import Kind
from worker_service.http.body import MAX_BODY_BYTES, BodyBudget, receiving
from worker_service.http.conditioning import CONDITIONING_FIELDS, form_json
from worker_service.http.errors import BodyTooLarge
from worker_service.http.params import (
    DECLARED,
    FIELDS,
    ImagesRequest,
    decimal_int,
    decimal_number,
    parse_generation,
)
from worker_service.http.values import shown_name
from worker_service.image_inputs import mask_from_alpha
from worker_service.validation import ValidationError

FILES = ("image", "mask")
MAX_FILES = len(FILES)
# Text fields of one body: every known one fits, with room for ignored ones.
MAX_FIELDS = 64
INTEGERS = frozenset({name for name, (_, kind) in DECLARED.items() if kind in (Kind.COUNT, Kind.SEED)}
                     | {"partial_images"})
NUMBERS = frozenset({name for name, (_, kind) in DECLARED.items() if kind is Kind.SCALE})
RESIZE_MODES = {"resize": worker_pb2.RESIZE_MODE_RESIZE, "crop": worker_pb2.RESIZE_MODE_CROP}
EDIT_FIELDS = frozenset({"strength", "resize_mode"})

# python-multipart logs a warning for each malformed body, which the caller is told of (400): one
# line per bad body would let a flood of them fill the disk.
logging.getLogger("python_multipart").setLevel(logging.ERROR)


async def read_edit(request: Request, budget: BodyBudget, max_size: int) -> ImagesRequest:
    """The edit request the multipart body holds; raises INVALID_ARGUMENT naming each bad field,
    BodyTooLarge past the budget's size, RESOURCE_EXHAUSTED when other bodies hold the budget."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise invalid_argument((), "the request body must be multipart/form-data (the image, the mask and "
                                   "the other fields as parts, as the OpenAI SDK's images.edit sends them)")
    async with reading_form(request, budget, MAX_FILES) as form:
        files: dict[str, bytes] = {}
        text: dict[str, str] = {}
        violations: list[tuple[str, str]] = []
        bad = violations.append
        for name, value in form.multi_items():
            if name in files or name in text:
                if name in FIELDS or name in EDIT_FIELDS or name in FILES:  # unknown ones are named once, as such
                    bad((name, "is given more than once"))
            elif isinstance(value, UploadFile):
                files[name] = await value.read()
                await value.close()
            else:
                text[name] = value
        del form
        parsed = _parsed(files, text, violations)
        image, mask = files.get("image", b""), files.get("mask", b"")
        if mask:
            try:
                mask = await mask_from_alpha(mask, "mask", max_size)
            except ValidationError as error:
                raise invalid_argument(error.violations) from None
        parsed.request.image, parsed.request.mask_image = image, mask
        return parsed


class _TextCheckingParser(MultiPartParser):
    """Starlette's parser, but a text part that is not valid in the body's charset (UTF-8 unless it
    declares another) is named in ``undecodable`` rather than decoded as Latin-1."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.undecodable: list[tuple[str, str]] = []

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                part.data.decode(self._charset)
            except UnicodeDecodeError as error:
                self.undecodable.append((shown_name(part.field_name),
                                         f"must be valid {self._charset}: byte {error.start} of this part is not"))
        super().on_part_end()


@contextlib.asynccontextmanager
async def reading_form(request: Request, budget: BodyBudget, max_files: int) -> AsyncIterator[FormData]:
    """The parts of a multipart body, bounded as the module says (at most ``max_files`` files),
    counted against ``budget`` until the block ends. Raises INVALID_ARGUMENT for a body that is
    not multipart/form-data and naming each text part that does not decode, BodyTooLarge past the
    budget's size, RESOURCE_EXHAUSTED when other bodies hold the budget."""
    too_big = BodyTooLarge(f"the request body is larger than {budget.max_bytes} bytes "
                           "(--http-max-body-bytes-in-flight)")
    async with receiving(request, budget, budget.max_bytes, too_big) as chunks:
        parser = _TextCheckingParser(request.headers, chunks, max_files=max_files, max_fields=MAX_FIELDS,
                                     max_part_size=MAX_BODY_BYTES)
        parser.spool_max_size = 0  # files stay in memory (0: never rolled over), bounded with the body
        try:
            form = await parser.parse()
        except MultiPartException as error:
            raise invalid_argument((), f"the request body is not valid multipart/form-data: {error.message}") from None
        if parser.undecodable:
            await form.close()
            raise invalid_argument(parser.undecodable)
        yield form


def _parsed(files: dict[str, bytes], text: dict[str, str], violations: list[tuple[str, str]]) -> ImagesRequest:
    """The request the fields say (its image and mask not attached yet); raises INVALID_ARGUMENT
    naming each bad field, ``violations`` first."""
    bad = violations.append
    if not files.get("image"):
        bad(("image", "is required: the image to edit, a file part (PNG, JPEG or WebP)"))
    for name in FILES:
        if name in text:
            bad((name, "must be a file part, not a text field"))
    body: dict[str, object] = {}
    for name in files:
        if name in FIELDS or name in EDIT_FIELDS:
            bad((name, "must be a text field, not a file part"))
        elif name not in FILES:
            body[name] = None  # parse_generation names it as unknown
    body.update((name, form_json(name, value, bad) if name in CONDITIONING_FIELDS and value
                 else form_field(name, value)) for name, value in text.items()
                if name not in FILES and name not in EDIT_FIELDS)
    try:
        parsed = parse_generation(body)
    except ServiceError as error:
        violations.extend(error.violations)
        parsed = None
    request = worker_pb2.GenerateRequest()
    _edit_fields(text, request, bad)
    if violations or parsed is None:
        raise invalid_argument(violations)
    parsed.request.MergeFrom(request)
    return parsed


def form_field(name: str, value: str, integers: Collection[str] = INTEGERS) -> object:
    """A text field as JSON would have typed it (``integers``: the names of its integer fields); a
    number that is not ASCII decimal stays text, for the parser to refuse naming it. Empty is absent
    (the SDK sends None as empty)."""
    if not value:
        return None
    number = decimal_int(value) if name in integers else decimal_number(value) if name in NUMBERS else None
    if number is not None:
        return number
    if name == "stream":
        return {"true": True, "false": False}.get(value, value)
    return value


def _edit_fields(text: dict[str, str], request: worker_pb2.GenerateRequest,
                 bad: Callable[[tuple[str, str]], None]) -> None:
    """``strength`` (its bounds are normalize's) and ``resize_mode`` into ``request``."""
    if text.get("strength"):
        strength = decimal_number(text["strength"])
        if strength is not None:
            request.strength = strength
        else:
            bad(("strength", f"must be a number in (0, 1], got {text['strength'][:40]!r}"))
    if text.get("resize_mode"):
        mode = RESIZE_MODES.get(text["resize_mode"])
        if mode is None:
            bad(("resize_mode", f"must be one of {', '.join(RESIZE_MODES)}, got {text['resize_mode'][:40]!r}"))
        else:
            request.resize_mode = mode
