"""The content of PushWeights updates, kept on disk so a restarted runner gets it back.

Each push is one file of length-prefixed serialized ``RunnerServicePushWeightsRequest`` messages
(the chunks, then the commit; the worker's ``PushWeightsRequest`` has the same wire form), written
while the stream arrives and replayed, chunk by chunk, to a runner that needs the update again.
``--max-pushed-bytes`` bounds the files kept and the pushes being written, together: each push
claims a tensor's declared bytes before it holds any of them, so concurrent pushes cannot each
count on the same free space. A file no update in effect refers to is deleted, at start too (a
push cut by a crash, or an update that a later one wholly replaced).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import struct
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import BinaryIO

from serving_common.owned_dirs import owned_temporary_directory, remove_abandoned

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")


class PushFile:
    """One push being written, and the bytes it has claimed (a ``tensor_stream.Budget``)."""

    def __init__(self, store: PushStore, path: Path) -> None:
        self.path = path
        self.reserved = 0
        self._store = store
        self._file: BinaryIO = path.open("xb")

    def left(self) -> int:
        return self._store.room()

    def reserve(self, nbytes: int) -> bool:
        if nbytes > self._store.room():
            return False
        self.reserved += nbytes
        return True

    def write(self, data: bytes) -> None:
        self._file.write(_LENGTH.pack(len(data)))
        self._file.write(data)

    def close(self) -> None:
        self._file.close()


# A worker's own push directory when --push-dir is empty, owned while it lives (serving_common.owned_dirs).
PUSH_DIR_PREFIX = "diffusion-pushes-"


class PushStore:
    """The directory of push files (``--push-dir``; a temporary one, removed at exit, when empty)."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self._temporary = not directory
        if self._temporary:  # and those of workers that were killed go now
            remove_abandoned(PUSH_DIR_PREFIX, lambda gone: logger.info("removed %s, left by a worker that was killed",
                                                                       gone))
        self.directory = Path(directory) if directory else owned_temporary_directory(PUSH_DIR_PREFIX)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._writing: dict[Path, PushFile] = {}
        self._kept = self._measure()

    def kept_bytes(self) -> int:
        """Bytes of the push files kept (those being written count by what they claimed): measured
        when a push ends or files go, not at each tensor a push claims."""
        return self._kept

    def _measure(self) -> int:
        return sum(path.stat().st_size for path in self.directory.glob("*.push") if path not in self._writing)

    def room(self) -> int:
        """Bytes a push may still claim within ``--max-pushed-bytes``."""
        claimed = sum(push.reserved for push in self._writing.values())
        return max(0, self.max_bytes - self.kept_bytes() - claimed)

    def create(self) -> PushFile:
        path = self.directory / f"{uuid.uuid4().hex}.push"
        push = self._writing[path] = PushFile(self, path)
        return push

    def finished(self, push: PushFile, keep: bool) -> None:
        push.close()
        self._writing.pop(push.path, None)
        if not keep:
            push.path.unlink(missing_ok=True)
        self._kept = self._measure()

    def keep_only(self, paths: Iterable[str]) -> None:
        """Deletes the push files no update in effect refers to (and none being written)."""
        wanted = {Path(p) for p in paths} | set(self._writing)
        for path in self.directory.glob("*.push"):
            if path not in wanted:
                path.unlink(missing_ok=True)
                logger.info("deleted %s: no weight update in effect refers to it", path)
        self._kept = self._measure()

    async def replay(self, path: str) -> AsyncIterator[bytes]:
        """A push file's serialized messages, read off the event loop one at a time."""
        with open(path, "rb") as file:
            while True:
                data = await asyncio.to_thread(_read_message, file)
                if data is None:
                    return
                yield data

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.directory, ignore_errors=True)


def _read_message(file: BinaryIO) -> bytes | None:
    header = file.read(_LENGTH.size)
    if not header:
        return None
    (length,) = _LENGTH.unpack(header)
    return file.read(length)
