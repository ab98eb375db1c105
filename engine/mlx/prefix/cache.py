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

With a tier on disk (``disk.py``) every stored entry is also handed to its writer, so a restarted worker
(even one killed) finds it; :meth:`PrefixCache.prefetch` starts reading a prompt's prefix from disk when the
disk holds more of it than memory does, and the entry joins the memory tier at the next fetch. An entry on disk
carries the affinity keys (``EngineRequest.affinity``, opaque here) of the prompts whose start it holds, so a
restarted worker knows which keys its disk holds (:meth:`PrefixCache.tagged`) before any of their jobs runs.
A system prompt's checkpoint whose prompt names a key for it alone (``system_key``: prompts sharing it share it)
is shared, not one conversation's: it goes to disk at once and stays there (bounded by the tier's budget) even
when a turn's entry follows, so a restarted worker holds, and advertises, the system prompt's key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from ...core.backend import DiskCounts, PrefixHit, SequenceCache
from .disk import PrefixDisk
from .trie import reach

__all__ = ["PrefixCache", "PrefixHit"]  # PrefixHit: engine/core/backend.py's, returned by fetch

_MODEL = "model"  # the cache serves one model: one trie
MAX_ENTRIES = 32
MIN_TOKENS = 64
TAG_TOKENS = 256  # a tagged prompt's start: an entry whose tokens begin with it carries the prompt's key
MAX_TAGGED = 1024  # prompt starts remembered with their keys (least recently fetched dropped first)
KEYS_PER_START = 8  # keys remembered for one start (conversations sharing a long system prompt)
MAX_SYSTEM_KEYS = 256  # system prompts' keys remembered (their checkpoints kept on disk)


class PrefixCache:
    """KV caches of prompt prefixes, at most ``max_bytes`` of them (LRU) in at most ``max_entries`` entries;
    prefixes shorter than ``min_tokens`` are not worth it."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES, min_tokens: int = MIN_TOKENS,
                 disk: PrefixDisk | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("a prefix cache needs a positive byte bound (0 disables it: build none)")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.disk = disk
        # the tagged prompts' starts by their first ``min_tokens`` tokens: {key: start}
        self._tags: OrderedDict[tuple[int, ...], dict[str, tuple[int, ...]]] = OrderedDict()
        self._system_keys: OrderedDict[str, None] = OrderedDict()  # the tagged keys that name a system prompt

    @property
    def nbytes(self) -> int:
        """Bytes of every entry's buffers."""
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: list[int], key: str = "", system_key: str = "") -> PrefixHit | None:
        """The longest cached prefix of ``tokens`` (a copy), or None (not counted for short prompts); ``key``
        and ``system_key`` (its system prompt's own, if any) are kept with the entries its prompt's start makes
        (:meth:`tag`)."""
        if len(tokens) <= self.min_tokens:
            return None
        if key:
            self.tag(tokens, key)
        if system_key:
            self.tag(tokens, system_key, system=True)
        self._take_arrived()
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
            if self.disk is not None:
                # a system prompt's checkpoint waits for its turn's entry, which supersedes it (disk.py), unless
                # other prompts share it (a key names it): then it is written and kept
                keys = self._keys_of(e.tokens)
                shared = kind == "system" and self._names_system(keys)
                self.disk.save(list(e.tokens), e.cache, kind, e.trimmable, keys=keys,
                               defer=kind == "system" and not shared, shared=shared)

    def tag(self, prompt: list[int], key: str, system: bool = False) -> None:
        """Remember ``key`` for ``prompt``'s start: entries stored from here on whose tokens begin with it carry
        it to disk (bounded: the least recently tagged starts are forgotten). ``system``: the key names the
        prompt's system prompt alone (its checkpoint is shared)."""
        if system:
            self._system_keys.pop(key, None)
            self._system_keys[key] = None
            while len(self._system_keys) > MAX_SYSTEM_KEYS:
                self._system_keys.popitem(last=False)
        start = tuple(prompt[:TAG_TOKENS])
        head = start[:self.min_tokens]
        keys = self._tags.setdefault(head, {})
        keys.pop(key, None)
        keys[key] = start
        while len(keys) > KEYS_PER_START:
            del keys[next(iter(keys))]
        self._tags.move_to_end(head)
        while len(self._tags) > MAX_TAGGED:
            self._tags.popitem(last=False)

    def _keys_of(self, tokens: list[int]) -> list[str]:
        """The keys tagged for the starts ``tokens`` begin with; a system prompt's key also for an entry that is
        a part of its start (its checkpoint, when the system prompt is shorter than the start)."""
        keys = self._tags.get(tuple(tokens[:self.min_tokens]))
        if not keys:
            return []
        return [k for k, start in keys.items() if tuple(tokens[:len(start)]) == start
                or (k in self._system_keys and tuple(tokens) == start[:len(tokens)])]

    def _names_system(self, keys: list[str]) -> bool:
        return any(k in self._system_keys for k in keys)

    def tagged(self) -> list[tuple[str, list[int]]]:
        """The keys the entries on disk carry, each with its entry's tokens, least recently used first."""
        return self.disk.tagged() if self.disk is not None else []

    def prefetch(self, tokens: list[int], done: Callable[[], None]) -> bool:
        """Start reading from disk the entry that holds more of ``tokens`` than memory does (by at least
        ``min_tokens``); True if one is being read, and ``done`` will be called (on another thread) once it
        has arrived, failed, or waited too long. The next :meth:`fetch` then finds it in memory."""
        if self.disk is None or len(tokens) <= self.min_tokens:
            return False
        self._take_arrived()
        held = self._held(tokens)
        found = self.disk.lookup(tokens)
        if found is None or found.tokens < held + self.min_tokens:
            if held < self.min_tokens and self.disk.readable:
                self.disk.counts.misses += 1
            return False
        return self.disk.load(found.key, done)

    def holds(self, prompts: list[list[int]]) -> list[bool]:
        """Whether memory or disk still holds (nearly) all of each of ``prompts`` (a prompt's start, for the
        worker's prefix affinity): a lookup in each tier's trie, no cache copied, nothing read from disk."""
        out = []
        for tokens in prompts:
            need = max(1, len(tokens) - 1)  # an exact hit gives its last token back to feed
            held = self._held(tokens) >= need
            if not held and self.disk is not None:
                found = self.disk.lookup(tokens)
                held = found is not None and found.tokens >= need
            out.append(held)
        return out

    def persist(self) -> None:
        """Hand every entry not on disk yet to the disk's writer (at a graceful stop: the warm ones survive)."""
        if self.disk is None:
            return
        # mlx-lm 0.32's LRUPromptCache keeps its order in _lru (per kind) and its entries in _trie.
        for kind, order in self._lru._lru._lrus.items():
            for model, tokens in list(order):
                entry = self._lru._trie.get(model, tokens)
                keys = self._keys_of(list(tokens))
                self.disk.save(list(tokens), entry.prompt_cache, kind, SequenceCache(entry.prompt_cache,
                               list(tokens)).trimmable, bounded=False, keys=keys,
                               shared=kind == "system" and self._names_system(keys))

    def close(self) -> None:
        """Finish the disk's writes (bounded) and stop its threads; blocking, off the MLX thread."""
        if self.disk is not None:
            self.disk.close()

    def disk_counts(self) -> DiskCounts | None:
        """The disk tier's counters, or None without one."""
        d = self.disk
        if d is None:
            return None
        c = d.counts
        return DiskCounts(c.hits, c.misses, c.errors, c.writes, c.dropped, d.nbytes, len(d))

    def _held(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the memory tier holds (its trie's answer, without copying a cache)."""
        found = reach(self._lru._trie, _MODEL, tokens)  # mlx-lm 0.32's trie: read, never changed here
        if found.exact is not None:
            return len(tokens)
        return max(found.shorter_len, found.walked)  # walked: an entry below holds that much (trimmed)

    def _take_arrived(self) -> None:
        """Entries read from disk since the last call join the memory tier."""
        if self.disk is None:
            return
        for tokens, cache, kind in self.disk.arrived():
            if sum(int(c.nbytes) for c in cache) <= self.max_bytes:
                self._lru.insert_cache(_MODEL, tokens, cache, cache_type=kind)

    def clear(self) -> None:
        """Drop every entry (after an engine failure: memory may be what failed)."""
        self._lru.trim_to(n_sequences=0)
