"""How a row's KV cache is made, kept and reused: how a sequence enters the batch, and what becomes of the caches
of rows that leave it.

A sequence enters by **recompute** (prefilled from nothing), **from a prefix** (only what follows its longest
cached prefix, ``engine/mlx/prefix/cache.py``), **resume** (its own cache, parked since it was preempted) or **start at
once** (prefilled alone, or in one batch with the others starting at once in its step, its first token sampled,
then joining as a resume does). :class:`ReuseCaches` does all four for a backend that hands caches out (mlx-lm's)
and keeps ended rows' caches for the prefix cache; :class:`Recompute` is for one that cannot (mlx-vlm's).
"""

from __future__ import annotations

import logging
from typing import Protocol, cast

from .backend import (
    BatchBackend,
    BatchToken,
    CachingBackend,
    GeneratedToken,
    PrefixHit,
    PrefixStore,
    SequenceCache,
    Started,
)
from .sequence import Sequence
from .stats import EngineStats

__all__ = ["CacheStrategy", "Recompute", "ReuseCaches", "strategy_for"]

log = logging.getLogger(__name__)


class CacheStrategy(Protocol):
    """What the scheduler asks of a backend's caches. Every call runs on the model's MLX thread."""

    starts_at_once: bool  # whether :meth:`start` can run (a new request prefilled alone)
    parks_caches: bool  # whether a preempted sequence can keep its cache to resume from

    @property
    def backend(self) -> BatchBackend: ...

    def prepare(self, seq: Sequence) -> None:
        """A sequence about to run for the first time."""

    def insert(self, seq: Sequence, parked: SequenceCache | None) -> int:
        """Put ``seq`` into the batch (resuming from ``parked``, its own cache, if given); its uid. A
        ValueError refuses this request alone."""

    def start(self, seq: Sequence) -> tuple[int, BatchToken]:
        """Prefill ``seq`` alone and sample its first token, then put it in the batch; its uid and that token."""

    @property
    def prestarted(self) -> int:
        """Sequences :meth:`prestart` readied that :meth:`start` has not taken yet."""

    def prestart(self, seqs: list[Sequence]) -> None:
        """Ready ``seqs`` (each to :meth:`start` in this step) together: those the backend can prefill in one batch
        are; :meth:`start` then takes each one's part. ``[]``: drop what is left."""

    def take(self, seqs: list[Sequence]) -> dict[int, SequenceCache]:
        """Take rows out of the batch, with their caches where the backend hands them out."""

    def park(self, seq: Sequence, cache: SequenceCache | None, keep_cache: bool) -> str | None:
        """A preempted sequence taken out with ``cache``: keep what its resume needs (its cache if ``keep_cache``
        and it can resume from it, else its tokens to recompute). A message if it cannot resume at all."""

    def retire(self, seq: Sequence) -> None:
        """Remove a row that ended while the batch still holds it."""

    def ended(self, seq: Sequence, tok: GeneratedToken) -> None:
        """A row's last token, as the backend ended it (it may carry the row's cache)."""

    def after_step(self) -> None:
        """Keep what the step left for the prefix cache."""

    def clear(self) -> None:
        """Drop every cache kept (after an engine failure: memory may be what failed)."""


def strategy_for(backend: BatchBackend, prefix: PrefixStore | None, stats: EngineStats) -> CacheStrategy:
    """:class:`ReuseCaches` for a backend that hands caches out, else :class:`Recompute`."""
    if getattr(backend, "supports_caches", False):
        return ReuseCaches(cast(CachingBackend, backend), prefix, stats)
    return Recompute(backend, stats)


class Recompute:
    """A backend without caches to hand out: every entry prefills from nothing, a resume included."""

    starts_at_once = False
    parks_caches = False

    def __init__(self, backend: BatchBackend, stats: EngineStats) -> None:
        self.backend = backend
        self.stats = stats

    def prepare(self, seq: Sequence) -> None:
        seq.history = []  # no cache to resume from: a preemption recomputes from the tokens

    def insert(self, seq: Sequence, parked: SequenceCache | None) -> int:
        req = seq.req
        if seq.admitted:
            self.stats.recomputes += 1
        full = req.prompt_tokens + seq.history if seq.history else req.prompt_tokens
        # Only an image request passes images: a backend that takes none keeps its plain insert.
        extra = {} if req.images is None else {"images": req.images}
        return self.backend.insert(full, seq.remaining, seq.sampler, seq.processors, **extra)

    def start(self, seq: Sequence) -> tuple[int, BatchToken]:
        raise NotImplementedError("a backend without caches cannot start a request at once")

    prestarted = 0

    def prestart(self, seqs: list[Sequence]) -> None:
        pass

    def take(self, seqs: list[Sequence]) -> dict[int, SequenceCache]:
        self.backend.remove([s.uid for s in seqs])
        return {}

    def park(self, seq: Sequence, cache: SequenceCache | None, keep_cache: bool) -> str | None:
        return None

    def retire(self, seq: Sequence) -> None:
        self.backend.remove([seq.uid])

    def ended(self, seq: Sequence, tok: GeneratedToken) -> None:
        pass

    def after_step(self) -> None:
        pass

    def clear(self) -> None:
        pass


class ReuseCaches:
    """A backend that hands caches out (:class:`~engine.core.backend.CachingBackend`), with an optional prefix cache."""

    starts_at_once = True
    parks_caches = True

    def __init__(self, backend: CachingBackend, prefix: PrefixStore | None, stats: EngineStats) -> None:
        self.backend = backend
        self.prefix = prefix
        self.stats = stats
        self._finished: list[SequenceCache] = []  # caches of rows that ended this step, for the prefix cache
        self._ready: dict[str, tuple[PrefixHit | None, Started | None]] = {}  # prestart()'s, by request id

    def prepare(self, seq: Sequence) -> None:
        pass  # its tokens come with its cache if it is preempted

    def insert(self, seq: Sequence, parked: SequenceCache | None) -> int:
        req, backend = seq.req, self.backend
        if req.images is not None:  # a backend that hands out caches (mlx-lm's) takes no images
            raise ValueError("this model does not accept images")
        full = req.prompt_tokens + seq.history if seq.history else req.prompt_tokens
        if parked is not None:  # resume from its own cache: no recomputation
            n = parked.resume_point(full)
            self.stats.resumes += 1
            return backend.insert(full[n:], seq.remaining, seq.sampler, seq.processors, cache=parked.cache,
                                  cache_tokens=full[:n])
        if seq.admitted:
            self.stats.recomputes += 1
        if self.prefix is None:
            return backend.insert(full, seq.remaining, seq.sampler, seq.processors)
        hit = self.prefix.fetch(full, req.affinity, req.system_key)
        self._sync_stats()
        cached = hit.tokens if hit is not None else 0
        if not seq.admitted:
            seq.cached = min(cached, len(req.prompt_tokens))
        boundary = req.cache_boundary
        checkpoint = boundary - cached if cached < boundary < len(full) else 0
        if hit is None and not checkpoint:  # the plain call, as any backend takes it
            return backend.insert(full, seq.remaining, seq.sampler, seq.processors)
        return backend.insert(full[cached:], seq.remaining, seq.sampler, seq.processors,
                              cache=hit.cache if hit is not None else None, cache_tokens=full[:cached],
                              checkpoint=checkpoint)

    @property
    def prestarted(self) -> int:
        return len(self._ready)

    def prestart(self, seqs: list[Sequence]) -> None:
        self._ready = {seq.rid: (self._fetch(seq), None) for seq in seqs}  # (a prefix hit starts on its own)
        plain = [seq for seq in seqs if self._ready[seq.rid][0] is None and not seq.processors
                 and len(seq.req.prompt_tokens) > 1]
        if len(plain) < 2:
            return
        try:
            started = self.backend.start_many([seq.req.prompt_tokens for seq in plain], [seq.sampler for seq in plain])
        except Exception:  # each then starts on its own, and a failure there fails the step as ever
            log.warning("could not prefill %d requests together; starting each alone", len(plain), exc_info=True)
            return
        self._ready.update((seq.rid, (None, one)) for seq, one in zip(plain, started))

    def start(self, seq: Sequence) -> tuple[int, BatchToken]:
        prompt = seq.req.prompt_tokens
        hit, started = self._ready.pop(seq.rid) if seq.rid in self._ready else (self._fetch(seq), None)
        cached = hit.tokens if hit is not None else 0
        if not seq.admitted:
            seq.cached = cached
        if started is None:
            started = self.backend.start(prompt[cached:], seq.sampler, seq.processors,
                                         cache=hit.cache if hit is not None else None, cache_tokens=prompt[:cached])
        more = seq.req.params.max_tokens - 1
        finish = started.finish_reason or ("length" if more == 0 else None)
        uid = self.backend.insert([started.token], max(more, 1), seq.sampler, seq.processors, cache=started.cache,
                                  cache_tokens=prompt)
        self.stats.started_at_once += 1
        return uid, BatchToken(uid, started.token, finish, logprobs=started.logprobs)

    def take(self, seqs: list[Sequence]) -> dict[int, SequenceCache]:
        return self.backend.take_caches([s.uid for s in seqs])

    def park(self, seq: Sequence, cache: SequenceCache | None, keep_cache: bool) -> str | None:
        prompt = len(seq.req.prompt_tokens)
        full = seq.length
        if seq.history is None:  # its first preemption: its tokens come with its cache
            if seq.generated and (cache is None or len(cache.tokens) < full):
                return "the engine lost the request's tokens when preempting it"
            seq.history = cache.tokens[prompt:full] if cache is not None else []
        if keep_cache and cache is not None and (len(cache.tokens) < full or cache.trimmable):
            seq.parked, seq.parked_bytes = cache, cache.nbytes
        return None

    def retire(self, seq: Sequence) -> None:
        if self._worth_keeping(seq):
            self._finished.extend(self.backend.take_caches([seq.uid]).values())
        else:
            self.backend.remove([seq.uid])

    def ended(self, seq: Sequence, tok: GeneratedToken) -> None:
        # mlx-lm's last response of a sequence carries its cache and every token in it.
        if not self._worth_keeping(seq):
            return
        cache, tokens = getattr(tok, "prompt_cache", None), getattr(tok, "all_tokens", None)
        if cache is not None and tokens is not None:
            self._finished.append(SequenceCache(list(cache), list(tokens)))

    def after_step(self) -> None:
        if self.prefix is None:
            return
        checkpoints = self.backend.take_checkpoints()
        if checkpoints:
            self.prefix.store(checkpoints, "system")
        if self._finished:
            self.prefix.store(self._finished, "assistant")
            self._finished = []
        elif not checkpoints:
            return
        self._sync_stats()

    def clear(self) -> None:
        self._finished, self._ready = [], {}
        if self.prefix is not None:
            self.prefix.clear()
            self._sync_stats()

    def _fetch(self, seq: Sequence) -> PrefixHit | None:
        if self.prefix is None:
            return None
        hit = self.prefix.fetch(seq.req.prompt_tokens, seq.req.affinity, seq.req.system_key)
        self._sync_stats()
        return hit

    def _worth_keeping(self, seq: Sequence) -> bool:
        # Only after a prompt long enough to be worth a lookup itself: copying a cache out is not free.
        return self.prefix is not None and len(seq.req.prompt_tokens) >= self.prefix.min_tokens

    def _sync_stats(self) -> None:
        p, stats = self.prefix, self.stats
        if p is not None:
            stats.prefix_hits, stats.prefix_misses, stats.prefix_tokens_saved = p.hits, p.misses, p.tokens_saved
            stats.prefix_cache_bytes, stats.prefix_cache_entries = p.nbytes, len(p)
            disk = p.disk_counts()
            if disk is not None:
                stats.take_disk(disk)

