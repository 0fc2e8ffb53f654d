"""Encoded prompts, kept between requests: the text encoders run once per distinct prompt.

Entries are keyed by everything the embeddings depend on: the weights version (LoadWeights and
PushWeights change it), the adapters active with their digests and scales (a LoRA may touch a
text encoder), whether classifier-free guidance encodes a negative, and the prompt and negative
prompt. A new weights version empties the cache, so stale entries do not hold memory until
evicted. The least recently used entries go first once the tensors exceed ``max_bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from runner_service.limits import DEFAULT_PROMPT_CACHE_BYTES

Embeddings = dict[str, torch.Tensor]  # the pipeline's own names: prompt_embeds, negative_prompt_embeds, ...

@dataclass(frozen=True)
class PromptCacheStats:
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int


def _size(embeddings: Embeddings) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in embeddings.values())


class PromptCache:
    """An LRU of encoded prompts, bounded in bytes; 0 bytes turns it off (every lookup encodes)."""

    def __init__(self, max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Embeddings] = OrderedDict()
        self._bytes = 0
        self._version = ""
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()  # read by GetInfo on the event loop while a step encodes

    def get(self, version: str, key: Hashable, encode: Callable[[], Embeddings]) -> Embeddings:
        """The embeddings for ``key`` under weights ``version``, encoding them on a miss."""
        with self._lock:
            if version != self._version:
                self._entries.clear()
                self._bytes, self._version = 0, version
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return found
            self._misses += 1
        embeddings = encode()
        size = _size(embeddings)
        with self._lock:
            if version == self._version and key not in self._entries and size <= self.max_bytes:
                self._entries[key] = embeddings
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, evicted = self._entries.popitem(last=False)
                    self._bytes -= _size(evicted)
        return embeddings

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(self._hits, self._misses, len(self._entries), self._bytes, self.max_bytes)
