"""Exact repeats answered from memory (issue 41 item 5): an opt-in cache of finished responses,
keyed by everything that decides their bytes. Off unless ``--result-cache-bytes`` is above 0.

The key is a sha256 over:

- what serves the request (``served_identity``): the loaded model as the runners report it in
  ``ModelInfo`` (source, revision, dtype, acceleration, parallelism, component overrides, fused
  adapters, scheduler...), less what changes while it serves (sleep state, measured costs); the
  weights version (which follows every LoadWeights and PushWeights); the adapters registered, each
  with its file's digest;
- every field of the request as normalized (``NormalizedRequest``: the ``GenerationParams`` with
  their defaults applied, and the worker's own fields such as the output format), but its request
  id; input images (image, mask, control and reference images, as the runner gets them) by their
  sha256. A field added to either is in the key by itself.

A request without an explicit seed gets a random one, so it never hits and is never stored; nor is
a request that asks for previews (a hit has no progress events to carry them).

An entry is the response as it was sent (images or videos, encoded in the request's output format,
which is in the key), less its request id and timings; a hit gets its own request id, and timings
with ``total_ms`` alone (``execute_ms`` 0, no runner timings: ``answered_from_memory``). Entries are
bounded by ``max_bytes`` and ``max_entries``, the least recently used going first; a response larger
than ``max_bytes`` is never stored.

``clear`` drops every entry and starts a new generation; a response that began under an older
generation (its request was looked up before the change) is not stored. The model controller calls
it when an operation that can change outputs takes the runners (``FanOut.exclusive``) and when a
runner is brought to the desired state again (``Reconciler.apply``: it loads the model anew).

Two identical requests in flight at once both miss and both run; the second to finish replaces the
first's (equal) entry.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import Message

from diffusion.v1 import common_pb2, worker_pb2
from worker_service.validation import NormalizedRequest

# Fields of a NormalizedRequest that name the call, not what it makes.
PER_CALL_FIELDS = frozenset({"request_id"})
# Fields of ModelInfo that change while the same model serves: what is asleep, the measured costs.
VOLATILE_MODEL_FIELDS = ("components", "sleep_level", "costs")
# What an entry holds beyond its response's bytes: its key and the bookkeeping (an estimate).
ENTRY_OVERHEAD_BYTES = 200


def served_identity(model: common_pb2.ModelInfo | None, weights_version: str,
                    adapters: Iterable[tuple[str, str]]) -> bytes:
    """What serves requests now, as bytes: the loaded ``model`` less its volatile fields, the
    ``weights_version`` and the registered ``adapters`` as (name, digest)."""
    stable = common_pb2.ModelInfo()
    if model is not None:
        stable.CopyFrom(model)
        for name in VOLATILE_MODEL_FIELDS:
            stable.ClearField(name)
    digest = hashlib.sha256(stable.SerializeToString(deterministic=True))
    digest.update(repr((weights_version, sorted(adapters))).encode())
    return digest.digest()


def _keyed(value: object) -> object:
    """``value`` as it goes into a key: a message (an input image) by the sha256 of its bytes."""
    if isinstance(value, Message):
        return hashlib.sha256(value.SerializeToString(deterministic=True)).hexdigest()
    if isinstance(value, tuple | list):
        return tuple(_keyed(item) for item in value)
    return value


def request_key(request: NormalizedRequest, identity: bytes) -> bytes:
    """The key of ``request`` served by ``identity``: every field but the per-call ones."""
    fields = tuple((f.name, _keyed(getattr(request, f.name))) for f in dataclasses.fields(request)
                   if f.name not in PER_CALL_FIELDS)
    return hashlib.sha256(identity + repr(fields).encode()).digest()


def answered_from_memory(response: worker_pb2.GenerateResponse) -> bool:
    """Whether ``response`` was a hit: nothing ran for it (a generation always has execute time)."""
    return response.timings.execute_ms == 0


@dataclass(frozen=True)
class Lookup:
    """A cacheable request's key, and the cache's generation when it was looked up."""

    key: bytes
    generation: int


@dataclass(frozen=True)
class ResultCacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int


class ResultCache:
    """Finished responses by key, within ``max_bytes`` (0: off) and ``max_entries``. ``identity``
    says what serves requests now (``served_identity``)."""

    def __init__(self, max_bytes: int, max_entries: int, identity: Callable[[], bytes]) -> None:
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._identity = identity
        self._entries: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._generation = 0
        self._hits = 0
        self._misses = 0

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    def lookup(self, request: NormalizedRequest, seeded: bool) -> Lookup | None:
        """The lookup of ``request`` (``seeded``: its seed was the caller's), or None when it is not
        cached: the cache is off, its seed was drawn, or it asks for previews."""
        if not self.enabled or not seeded or request.partial_images:
            return None
        return Lookup(request_key(request, self._identity()), self._generation)

    def get(self, lookup: Lookup) -> worker_pb2.GenerateResponse | None:
        """The response stored under ``lookup``'s key (a fresh message, without request id or
        timings), or None; counts a hit or a miss."""
        stored = self._entries.get(lookup.key)
        if stored is None or lookup.generation != self._generation:
            self._misses += 1
            return None
        self._hits += 1
        self._entries.move_to_end(lookup.key)
        return worker_pb2.GenerateResponse.FromString(stored)

    def put(self, lookup: Lookup, response: worker_pb2.GenerateResponse) -> None:
        """Stores ``response`` under ``lookup``'s key unless the cache was cleared since the lookup
        or the response alone is more than the budget; the least recently used entries make room."""
        if lookup.generation != self._generation or response.ByteSize() + ENTRY_OVERHEAD_BYTES > self._max_bytes:
            return
        stored = worker_pb2.GenerateResponse(images=response.images, videos=response.videos,
                                             weights_version=response.weights_version,
                                             model=response.model).SerializeToString()
        self._drop(lookup.key)
        size = len(stored) + ENTRY_OVERHEAD_BYTES
        while self._entries and (len(self._entries) >= self._max_entries or self._bytes + size > self._max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[lookup.key] = stored
        self._bytes += size

    def clear(self) -> None:
        """Drops every entry; responses of requests looked up before now are not stored."""
        self._entries.clear()
        self._bytes = 0
        self._generation += 1

    def stats(self) -> ResultCacheStats:
        return ResultCacheStats(self._hits, self._misses, len(self._entries), self._bytes)

    def _drop(self, key: bytes) -> None:
        stored = self._entries.pop(key, None)
        if stored is not None:
            self._bytes -= len(stored) + ENTRY_OVERHEAD_BYTES
