"""The prefix (prompt) KV cache: mlx-lm's ``LRUPromptCache``, bounded by bytes, behind two calls (an MLX adapter:
the scheduler and the cache strategy know it as ``backend.PrefixStore``).

:meth:`PrefixCache.fetch` finds the longest cached prefix of a prompt (a copy, possibly trimmed from a longer
entry); :meth:`PrefixCache.store` keeps a sequence's cache at the system-prompt boundary while it prefills and
whole when it ends, so a system prompt and a chat's earlier turns prefill once. Every call runs on the model's
MLX thread. Eviction is mlx-lm's (least recently stored first; answers before prompts before system prompts),
and a stored cache drops the entries that are its prefixes, as mlx-lm's server does.

Two bounds keep it off the hot path: prompts shorter than ``min_tokens`` are neither looked up nor stored (a
hit would save less prefill than the copies cost), and the entries are few (``max_entries``): mlx-lm's lookup
walks every entry that shares the prompt's longest cached prefix, on the engine thread.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from .backend import PrefixHit, SequenceCache

__all__ = ["PrefixCache", "PrefixHit"]  # PrefixHit: backend.py's, returned by fetch

_MODEL = "model"  # the cache serves one model: one trie
MAX_ENTRIES = 32
MIN_TOKENS = 64


class PrefixCache:
    """KV caches of prompt prefixes, at most ``max_bytes`` of them (LRU) in at most ``max_entries`` entries;
    prefixes shorter than ``min_tokens`` are not worth it."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES, min_tokens: int = MIN_TOKENS) -> None:
        if max_bytes <= 0:
            raise ValueError("a prefix cache needs a positive byte bound (0 disables it: build none)")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0

    @property
    def nbytes(self) -> int:
        """Bytes of every entry's buffers."""
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: list[int]) -> PrefixHit | None:
        """The longest cached prefix of ``tokens`` (a copy), or None (not counted for short prompts)."""
        if len(tokens) <= self.min_tokens:
            return None
        cache, rest = self._lru.fetch_nearest_cache(_MODEL, tokens)
        n = len(tokens) - len(rest)
        if cache is None or n < self.min_tokens:
            self.misses += 1
            return None
        if not rest:  # an exact hit gives its last token back to feed, or is no hit if it cannot
            held = SequenceCache(cache, tokens[:n])
            if not held.trimmable:
                self.misses += 1
                return None
            n = held.resume_point(tokens)
        self.hits += 1
        self.tokens_saved += n
        return PrefixHit(cache, n)

    def store(self, entries: list[SequenceCache], kind: str) -> None:
        """Keep each entry's cache under its tokens; ``kind`` ("system" or "assistant") orders eviction."""
        entries = [e for e in entries if len(e.tokens) >= self.min_tokens]
        if not entries:
            return
        mx.eval([c.state for e in entries for c in e.cache])  # a lazy slice would pin the whole batch's buffer
        for e in entries:
            if e.nbytes > self.max_bytes:  # it would evict everything, then itself
                continue
            self._lru.insert_cache(_MODEL, list(e.tokens), e.cache, cache_type=kind)

    def clear(self) -> None:
        """Drop every entry (after an engine failure: memory may be what failed)."""
        self._lru.trim_to(n_sequences=0)
