"""The generation parameters text written into an encoded image where A1111 reads it back: a PNG
text chunk ``parameters``, or the EXIF UserComment of a JPEG or a WebP.

The text goes into the encoder's bytes as they are (a chunk or segment spliced in, nothing
re-encoded), so every encoder of ``pixel_encoders`` gets it the same way and keeps its speed:

- PNG: a ``tEXt`` chunk right after the header (``iTXt``, UTF-8, when the text is not Latin-1), as
  Pillow's ``PngInfo.add_text`` writes it, a NUL of the text (a prompt may hold one; a PNG text
  may not) written as U+FFFD;
- JPEG: an APP1 Exif segment after the JFIF one; a text too long for a segment (64 KiB: a prompt
  of some 16,000 characters) is left out of the file;
- WebP: an ``EXIF`` chunk, the file turned into WebP's extended format (``VP8X``) to hold it.

The EXIF holds one tag, UserComment (0x9286 in the Exif IFD), as A1111 (piexif) writes it:
``UNICODE\\0`` and the text in UTF-16, big-endian, in a big-endian TIFF.
"""

from __future__ import annotations

import struct
import zlib

from diffusion.v1 import worker_pb2

KEYWORD = b"parameters"
USER_COMMENT = 0x9286
EXIF_IFD = 0x8769
_PNG_HEADER_END = 8 + 25  # the signature, then IHDR (length, type, 13 bytes, CRC)
_JPEG_MAX_SEGMENT = 0xFFFF  # a segment's length field counts itself
_VP8X_EXIF = 0x08  # VP8X flags
_VP8X_ALPHA = 0x10


def with_parameters(data: bytes, output_format: int, text: str, width: int, height: int) -> bytes:
    """``data``, an encoded ``width`` x ``height`` image in ``output_format`` (PNG, JPEG or WEBP),
    with ``text`` written into it."""
    if output_format == worker_pb2.OUTPUT_FORMAT_PNG:
        return _png(data, text)
    if output_format == worker_pb2.OUTPUT_FORMAT_JPEG:
        return _jpeg(data, text)
    if output_format == worker_pb2.OUTPUT_FORMAT_WEBP:
        return _webp(data, text, width, height)
    raise ValueError(f"output format {output_format} holds no parameters")


def _png(data: bytes, text: str) -> bytes:
    if data[12:16] != b"IHDR":
        raise ValueError("not a PNG: no IHDR chunk after the signature")
    text = text.replace("\0", "\ufffd")  # a PNG text chunk's text may hold no NUL (PNG 11.3.3.2, 11.3.3.4)
    try:
        chunk = _png_chunk(b"tEXt", KEYWORD + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:  # iTXt: not compressed, no language tag, no translated keyword
        chunk = _png_chunk(b"iTXt", KEYWORD + b"\0\0\0\0\0" + text.encode("utf-8"))
    return data[:_PNG_HEADER_END] + chunk + data[_PNG_HEADER_END:]


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _jpeg(data: bytes, text: str) -> bytes:
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG: no start of image")
    payload = b"Exif\0\0" + exif_tiff(text)
    if len(payload) + 2 > _JPEG_MAX_SEGMENT:
        return data
    at = 2
    if data[2:4] == b"\xff\xe0":  # JFIF's APP0 comes first
        at = 4 + int.from_bytes(data[4:6], "big")
    return data[:at] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[at:]


def _webp(data: bytes, text: str, width: int, height: int) -> bytes:
    if data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        raise ValueError("not a WebP: no RIFF WEBP header")
    chunks, kind = data[12:], data[12:16]
    if kind == b"VP8X":
        chunks = chunks[:8] + bytes([chunks[8] | _VP8X_EXIF]) + chunks[9:]
    else:  # a simple file: one VP8 (lossy) or VP8L (lossless) chunk
        # VP8L: a 0x2f byte, then 14 bits of width - 1, 14 of height - 1, and whether alpha is used.
        alpha = kind == b"VP8L" and int.from_bytes(chunks[9:13], "little") >> 28 & 1
        flags = _VP8X_EXIF | (_VP8X_ALPHA if alpha else 0)
        header = bytes([flags, 0, 0, 0]) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
        chunks = _riff_chunk(b"VP8X", header) + chunks
    chunks += _riff_chunk(b"EXIF", exif_tiff(text))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WEBP" + chunks


def _riff_chunk(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("<I", len(body)) + body + b"\0" * (len(body) % 2)


def exif_tiff(text: str) -> bytes:
    """A big-endian TIFF of one IFD pointing to an Exif IFD that holds UserComment: ``text`` as A1111
    writes it (``UNICODE\\0``, then UTF-16BE)."""
    comment = b"UNICODE\0" + text.encode("utf-16-be")
    exif_ifd = 8 + 2 + 12 + 4  # after the header and IFD0 (one entry)
    comment_at = exif_ifd + 2 + 12 + 4  # after the Exif IFD (one entry)
    long, undefined = 4, 7  # TIFF field types
    return (b"MM\0\x2a" + struct.pack(">I", 8)
            + struct.pack(">HHHII", 1, EXIF_IFD, long, 1, exif_ifd) + struct.pack(">I", 0)
            + struct.pack(">HHHII", 1, USER_COMMENT, undefined, len(comment), comment_at) + struct.pack(">I", 0)
            + comment)
