"""What the scheduler works against: the batch backend's protocols and the plain records they pass.

Nothing here imports MLX: a KV cache is held as it is (a list of per-layer caches, read only through
:class:`LayerCache`), and a token's log-probabilities stay the backend's own vectors, read back by the backend
(:meth:`BatchBackend.attach_logprobs`). The MLX adapters (``engine/mlx/batch.py``, ``engine/mlx/vlm.py``)
implement these; the scheduler's tests drive them with fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .request import ImageInputs, RequestOutput

__all__ = ["BatchBackend", "BatchToken", "CachingBackend", "DiskCounts", "GeneratedToken", "LayerCache",
           "LogprobsAsked", "PrefixHit", "PrefixStore", "SequenceCache", "Started"]

# A token whose log-probabilities are asked for: its output, the token, the vector it was sampled from (the
# backend's own array over the vocabulary) and how many top alternatives to report.
LogprobsAsked = tuple[RequestOutput, int, Any, int]


class GeneratedToken(Protocol):
    """One generated token as a step reports it: mlx-lm's own response object, read as it is (copying it
    cost a record per token on the engine thread). ``finish_reason`` is "stop" (an EOS token: not part of
    the text), "length", or None."""

    @property
    def uid(self) -> int: ...
    @property
    def token(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...


@dataclass(slots=True)
class BatchToken:
    """A :class:`GeneratedToken` of a backend's own making (fakes in tests). A sequence's last token may
    carry its KV cache and the tokens in it, as mlx-lm's final response does."""

    uid: int
    token: int
    finish_reason: str | None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None
    logprobs: Any = None  # the log-probabilities it was sampled from (an MLX array over the vocabulary)


class LayerCache(Protocol):
    """What the core reads of one layer's KV cache (mlx-lm's caches have these)."""

    @property
    def nbytes(self) -> int: ...
    def is_trimmable(self) -> bool: ...
    def trim(self, n: int) -> int: ...


@dataclass(slots=True)
class SequenceCache:
    """One sequence's KV cache out of a batch (a list of per-layer caches) and the tokens it holds."""

    cache: list[Any]
    tokens: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes of the caches' buffers (allocated, not only used)."""
        return sum(int(c.nbytes) for c in self.cache)

    @property
    def trimmable(self) -> bool:
        """Whether tokens can be taken off its end (not a sliding window that moved, nor recurrent state):
        every layer's can (mlx-lm's ``can_trim_prompt_cache``)."""
        return all(c.is_trimmable() for c in self.cache)

    def keep(self, n: int) -> None:
        """Trim it to its first ``n`` tokens (it must be :attr:`trimmable`; as mlx-lm's ``trim_prompt_cache``)."""
        if n < len(self.tokens):
            if self.trimmable:
                for c in self.cache:
                    c.trim(len(self.tokens) - n)
            del self.tokens[n:]

    def resume_point(self, tokens: list[int]) -> int:
        """Ready it to go on as the sequence ``tokens`` (which start with its own): how many of them it
        holds. At least one token is left to feed (an empty prompt kills mlx-lm's batch): when it holds them
        all it gives the last one back, to be fed again."""
        n = min(len(self.tokens), len(tokens) - 1)
        self.keep(n)
        return n


@dataclass(slots=True)
class Started:
    """A sequence prefilled on its own (:meth:`CachingBackend.start`): its first token, whether that token
    ended it ("stop": an EOS token), and its KV cache, which holds the prompt (not yet the first token)."""

    token: int
    finish_reason: str | None
    cache: list[Any]
    logprobs: Any = None  # what the first token was sampled from (an MLX array over the vocabulary)


class BatchBackend(Protocol):
    """What the scheduler needs from a continuous batch (real: ``engine.mlx.batch.MLXBatch``,
    ``engine.mlx.vlm.VLMBatch``; tests: a fake). ``images`` is passed only with an image request: a backend without
    images may omit it."""

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        images: ImageInputs | None = None,
    ) -> int: ...

    def remove(self, uids: Iterable[int]) -> None: ...

    def step(self) -> Sequence[GeneratedToken]: ...

    def attach_logprobs(self, asked: list[LogprobsAsked]) -> None:
        """Each asked-for token's log-probability and its row's top alternatives, appended to its output (the
        vectors are the backend's own: only it reads them). Called only when a step's tokens ask for them."""
        ...

    def close(self) -> None: ...


class CachingBackend(BatchBackend, Protocol):
    """A backend whose sequences' KV caches can come and go (``supports_caches`` is True). A backend without
    this (mlx-vlm's) still serves: the scheduler then skips the prefix cache and preempts by recomputing."""

    @property
    def supports_caches(self) -> bool: ...

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        cache: list[Any] | None = None,
        cache_tokens: list[int] | None = None,
        checkpoint: int = 0,
        images: ImageInputs | None = None,
    ) -> int:
        """``cache`` holds ``cache_tokens`` (which precede ``prompt``); ``checkpoint``: a position in ``prompt``
        where the sequence's cache is to be taken a copy of (see :meth:`take_checkpoints`)."""
        ...

    def start(
        self,
        prompt: list[int],
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        cache: list[Any] | None = None,
        cache_tokens: list[int] | None = None,
    ) -> Started:
        """Prefill ``prompt`` alone (after ``cache``, which holds ``cache_tokens``) and sample its first token,
        outside the batch and at once; the caller inserts it with the returned cache to go on."""
        ...

    def start_many(self, prompts: list[list[int]], samplers: list[Callable[[Any], Any] | None]) -> list[Started]:
        """:meth:`start` of several prompts (no cache, no logits processors, two tokens at least), prefilled together
        where the backend can (one pass costs about what one prompt's does): each one's first token as it would
        be alone."""
        ...

    def take_caches(self, uids: Iterable[int]) -> dict[int, SequenceCache]:
        """Remove sequences, returning each one's cache (evaluated) and the tokens in it."""
        ...

    def take_checkpoints(self) -> list[SequenceCache]:
        """Caches copied at the checkpoints the last steps reached (evaluated), once each."""
        ...

    def kv_bytes(self) -> int:
        """Bytes of every sequence's KV cache in the batch, as allocated."""
        ...


@dataclass(slots=True)
class PrefixHit:
    """A copy of a cached prefix's KV cache, holding the prompt's first ``tokens`` tokens (at least one
    prompt token is always left to feed)."""

    cache: list[Any]
    tokens: int


@dataclass(frozen=True, slots=True)
class DiskCounts:
    """The prefix cache's tier on disk, as counted since the engine started (bytes and entries: now)."""

    hits: int  # entries read from disk for a request
    misses: int  # requests whose prefix neither memory nor disk held
    errors: int  # entries that could not be read (their requests prefilled cold)
    writes: int
    dropped: int  # entries not written: the writer was too far behind
    bytes: int
    entries: int


class PrefixStore(Protocol):
    """The prefix (prompt) KV cache as the cache strategy uses it (real: ``engine.mlx.prefix.cache.PrefixCache``)."""

    min_tokens: int  # prompts shorter than this are neither looked up nor stored
    hits: int
    misses: int
    tokens_saved: int

    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...

    def fetch(self, tokens: list[int], key: str = "", system_key: str = "") -> PrefixHit | None:
        """The longest cached prefix of ``tokens`` (a copy), or None; ``key``: the request's affinity key, kept
        with the entries its prompt makes; ``system_key``: its system prompt's own, shared by other prompts (so
        that checkpoint is kept on disk)."""
        ...

    def tagged(self) -> list[tuple[str, list[int]]]:
        """The affinity keys the slower tier's entries carry, each with its entry's tokens, least recently used
        first (thread-safe)."""
        ...

    def store(self, entries: list[SequenceCache], kind: str) -> None:
        """Keep each entry's cache under its tokens; ``kind`` ("system" or "assistant") orders eviction."""
        ...

    def clear(self) -> None: ...

    def holds(self, prompts: list[list[int]]) -> list[bool]:
        """Whether memory or disk still holds (nearly) all of each of ``prompts``."""
        ...

    def prefetch(self, tokens: list[int], done: Callable[[], None]) -> bool:
        """Start loading a longer prefix of ``tokens`` than memory holds from a slower tier; True: ``done`` is
        called (on another thread) once the next :meth:`fetch` can find it."""
        ...

    def persist(self) -> None:
        """At a graceful stop (on the MLX thread): keep what memory holds in the slower tier."""
        ...

    def close(self) -> None:
        """Stop the slower tier's threads, its writes finished (blocking; not on the MLX thread)."""
        ...

    def disk_counts(self) -> DiskCounts | None: ...
