"""Model roots: the only directories LoadModel and LoadWeights may read from, and how files there are read.

Every file the runner reads for a caller is resolved (symlinks and ``..`` included) and checked
against the roots, and must be a regular file: a device, FIFO or socket is refused from its
``stat``, without being opened (a FIFO would block the read, ``/dev/zero`` never ends it).
Reads are bounded, so a file that grows while it is read cannot exceed its budget.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from serving_common.errors import ServiceError, invalid_argument

# A model directory with more entries than this is refused rather than walked (a real model has
# a few dozen; the walk must stay cheap even when a source names a huge tree).
MAX_MODEL_ENTRIES = 100_000
# Files in one LoadWeights directory (a sharded checkpoint has at most a few hundred).
MAX_WEIGHT_FILES = 10_000
READ_CHUNK_BYTES = 16 * 1024 * 1024
# Opening never follows a symlink in the last component (the path was resolved already) and
# never waits on a FIFO that was swapped in after the check.
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


@dataclass(frozen=True)
class RegularFile:
    """A file checked for reading: the name it was asked by, where it really is, its size then."""

    shown: Path
    resolved: Path
    size: int


class ModelRoots:
    """Confines filesystem reads to configured directories; with none configured, any path is allowed.

    Paths are resolved (symlinks and ``..`` included) before the check, and the check comes
    before anything is read.
    """

    def __init__(self, roots: list[Path] | None = None) -> None:
        self.roots = [Path(root).resolve() for root in roots or []]

    def _require_inside(self, resolved: Path, shown: Path | str, field: str) -> None:
        if self.roots and not any(resolved.is_relative_to(root) for root in self.roots):
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{field} {str(shown)!r} is outside the runner's model roots ({', '.join(map(str, self.roots))})",
            )

    def check(self, path: str | Path, field: str) -> Path:
        """``path`` resolved; PERMISSION_DENIED when it lands outside the roots."""
        resolved = Path(path).resolve()
        self._require_inside(resolved, path, field)
        return resolved

    def regular_file(self, path: str | Path, field: str) -> RegularFile:
        """``path`` resolved and checked: inside the roots, and a regular file (from ``stat``, not opened)."""
        resolved = self.check(path, field)
        try:
            status = os.stat(resolved)
        except FileNotFoundError:
            raise invalid_argument({field: f"{path} does not exist on the runner"}) from None
        except OSError as error:
            raise invalid_argument({field: f"{path} cannot be read: {error.strerror}"}) from None
        if not stat.S_ISREG(status.st_mode):
            raise invalid_argument({field: f"{path} is {_kind(status.st_mode)}, not a regular file"})
        return RegularFile(Path(path), resolved, status.st_size)

    def read(self, file: RegularFile, field: str, limit: int) -> bytes:
        """The bytes of a checked file, at most ``limit`` of them (INVALID_ARGUMENT beyond).

        The opened descriptor is checked again (still a regular file, still inside the roots),
        so a file swapped after ``regular_file`` is not read either.
        """
        try:
            descriptor = os.open(file.resolved, OPEN_FLAGS)
        except OSError as error:
            raise invalid_argument({field: f"{file.shown} cannot be opened: {error.strerror}"}) from None
        with os.fdopen(descriptor, "rb", buffering=0) as handle:
            mode = os.fstat(descriptor).st_mode
            if not stat.S_ISREG(mode):
                raise invalid_argument({field: f"{file.shown} is {_kind(mode)}, not a regular file"})
            opened = Path(f"/proc/self/fd/{descriptor}")
            if self.roots and opened.is_symlink():
                self._require_inside(Path(os.readlink(opened)), file.shown, field)
            chunks, total = [], 0
            while chunk := handle.read(min(READ_CHUNK_BYTES, limit + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise invalid_argument({field: f"{file.shown} grew past the limit of {limit} bytes while read"})
        return b"".join(chunks)

    def model_tree(self, directory: Path, field: str) -> int:
        """Checks every entry under a model directory before anything is loaded from it.

        Each entry is resolved and must land inside the roots (PERMISSION_DENIED) and be a
        directory or a regular file (INVALID_ARGUMENT); symlinked directories are walked where
        they lead. Returns the bytes of the files found (what loading will read at most).
        """
        total, entries = 0, 0
        seen = {directory}
        pending = [directory]
        while pending:
            current = pending.pop()
            try:
                listing = sorted(os.scandir(current), key=lambda entry: entry.name)
            except OSError as error:
                raise invalid_argument({field: f"{current} cannot be listed: {error.strerror}"}) from None
            for entry in listing:
                entries += 1
                if entries > MAX_MODEL_ENTRIES:
                    raise invalid_argument({field: f"{directory} holds more than {MAX_MODEL_ENTRIES} entries"})
                shown = Path(entry.path)
                resolved = self.check(shown, field)
                try:
                    status = os.stat(resolved)
                except OSError:
                    raise invalid_argument({field: f"{shown} is a broken link"}) from None
                if stat.S_ISDIR(status.st_mode):
                    if resolved not in seen:
                        seen.add(resolved)
                        pending.append(resolved)
                elif stat.S_ISREG(status.st_mode):
                    total += status.st_size
                else:
                    raise invalid_argument({field: f"{shown} is {_kind(status.st_mode)}, not a regular file"})
        return total
