"""Speculative decoding inside mlx-lm's continuous batch.

A step proposes ``k`` tokens for every row (a draft model, or prompt lookup), scores all rows' ``k + 1``
positions in one forward pass of the target, and keeps each row's prefix of proposals the target agrees with
(greedy rows: its argmax; unseeded sampled rows: the speculative-sampling rule) plus the target's own next
token. A row takes the positions it rejected off its own end in both models' caches, without moving the others
(:class:`RaggedKVCache`). Seeded, penalised and constrained rows take no proposals, so their tokens are exactly
plain decoding's; ``k`` is chosen per step from the measured acceptance and step times (0: plain decoding), so
speculation turns itself off where it does not pay."""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .sampling import RowSampler
from .stats import EngineStats

__all__ = ["DraftModel", "PromptLookup", "RaggedKVCache", "SpecBatch", "SpecKind", "Speculation", "Tuner",
           "check_cache", "ragged", "repeat_shapes", "rollback"]


class SpecKind(enum.Enum):
    DRAFT = "draft"  # a smaller model with the target's vocabulary proposes
    NGRAM = "ngram"  # the row's own prompt and output propose (prompt lookup)


@dataclass(frozen=True, slots=True)
class Speculation:
    """How an engine speculates. ``draft``: the draft model's path (with :attr:`SpecKind.DRAFT`)."""

    kind: SpecKind
    draft: str | None = None
    max_k: int = 4  # the most tokens proposed per row and step


class Proposer(Protocol):
    """Proposes tokens for every row of a :class:`SpecBatch` and follows its rows."""

    def joined(self, batch: SpecBatch, start: int) -> None:
        """Rows ``start:`` of ``batch`` are new (their ``tokens`` are what the target's cache holds)."""

    def filter(self, keep: list[int]) -> None: ...

    def propose(self, batch: SpecBatch, pending: mx.array, k: int) -> mx.array | None:
        """``(B, k)`` proposals following each row's ``tokens`` and its pending token (``pending``, ``(B,)``);
        None when no row has one worth verifying (the step then decodes plainly)."""
        ...

    def settle(self, accepted: list[int], k: int) -> None:
        """Each row kept ``accepted[i]`` of its ``k`` proposals."""

    def kv_bytes(self) -> int: ...


def check_cache(model: Any) -> str | None:
    """Why ``model``'s KV cache cannot be rolled back per row (None: it can): only plain KV caches can."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
    return f"its KV cache ({', '.join(sorted(kinds))}) cannot be rolled back per row" if kinds else None


class RaggedKVCache(BatchKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's batched KV cache in which each row ends where its own tokens end (``ends``), so a row takes
    positions off its end without moving the others or copying the cache: the next tokens of a row are written
    at its end, over what it dropped, and each row attends only up to its own end. Rows are left-padded to the
    longest (as in mlx-lm's), which a row that keeps fewer proposals falls behind."""

    ends: list[int]
    keys: Any
    values: Any

    fixed: bool  # a pass over several positions attends over the whole buffer (see :meth:`make_mask`)

    @classmethod
    def adopt(cls, cache: BatchKVCache, fixed: bool = False) -> RaggedKVCache:
        """``cache`` (every row ending at its last position) as a ragged cache, in place."""
        cache.__class__ = cls
        adopted = cast(RaggedKVCache, cache)
        adopted.ends = [cache._idx] * int(cache.offset.shape[0])
        adopted.fixed = fixed
        return adopted

    @property
    def _even(self) -> bool:
        return all(e == self._idx for e in self.ends)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        spread = self.fixed and n > 1
        if self._even and not spread:
            out = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return out  # type: ignore[no-any-return]
        if spread:
            self._align(max(self.ends) + n, keys, values)
        else:
            self._reserve(max(self.ends) + n, keys, values)
        at = (mx.array(self.ends)[:, None] + mx.arange(n)[None])[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        self.ends = [e + n for e in self.ends]
        self.offset = self.offset + n
        self._idx = max(self.ends)
        if spread:
            return self.keys, self.values
        return self.keys[..., :self._idx, :], self.values[..., :self._idx, :]

    def _reserve(self, size: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``size`` positions, grown as mlx-lm grows its buffers (steps of ``self.step``)."""
        if self.keys is not None and size <= self.keys.shape[2]:
            return
        b, heads, _, dk = keys.shape
        grow = -(-size // self.step) * self.step - (0 if self.keys is None else self._idx)
        new_k = mx.zeros((b, heads, grow, dk), keys.dtype)
        new_v = mx.zeros((b, heads, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[..., :self._idx, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., :self._idx, :], new_v], axis=2)

    def _align(self, size: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``size`` positions in a buffer of whole steps (a filter's shift leaves it ragged), the same
        in every layer's cache."""
        have = 0 if self.keys is None else int(self.keys.shape[2])
        self._reserve(-(-max(size, have) // self.step) * self.step, keys, values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:  # mlx-lm's name
        """The mask of a pass over ``N`` new positions. With :attr:`fixed`, a pass over several positions
        attends over the whole buffer (its length moves in steps of 256), the positions past each row's end
        masked: on CUDA an attention over several query positions runs a cuDNN graph built and cached per exact
        shape, and a key length that grows by a different amount every step built a new graph every step."""
        spread = self.fixed and N > 1 and self.keys is not None
        if self._even and not spread:
            return super().make_mask(N, return_array=return_array, **kwargs)
        width = max(self.ends) + N
        if spread:
            self._align(width, self.keys, self.values)
            width = int(self.keys.shape[2])
        query = mx.array(self.ends)[:, None] + mx.arange(N)[None]  # each row's new positions
        key = mx.arange(width)[None, None]
        mask = (key <= query[:, :, None]) & (key >= self.left_padding[:, None, None])
        return mask[:, None]

    def retreat(self, drop: Sequence[int]) -> None:
        """Take ``drop[i]`` positions off the end of row ``i``."""
        self.ends = [e - d for e, d in zip(self.ends, drop)]
        self.offset = self.offset - mx.array(list(drop))
        self._idx = max(self.ends)

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self.retreat([n] * len(self.ends))
        return n

    def filter(self, batch_indices: Any) -> None:
        ends = [self.ends[i] for i in batch_indices]
        shift = self._idx
        super().filter(batch_indices)
        shift -= self._idx  # the padding every kept row had, cut from their fronts
        self.ends = [e - shift for e in ends]
        self._idx = max(self.ends)

    def extend(self, other: Any) -> None:
        ours = self.ends
        theirs = other.ends if isinstance(other, RaggedKVCache) else [other._idx] * int(other.offset.shape[0])
        top = max(self._idx, other._idx)
        base_self, base_other = self._idx, other._idx
        super().extend(other)
        self.ends = [e + top - base_self for e in ours] + [e + top - base_other for e in theirs]
        self._idx = max(self.ends)

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        start, end = _ints(self.left_padding)[idx], self.ends[idx]
        cache.keys = mx.contiguous(self.keys[idx:idx + 1, :, start:end])
        cache.values = mx.contiguous(self.values[idx:idx + 1, :, start:end])
        cache.offset = end - start
        return cache


def ragged(caches: list[Any], fixed: bool = False) -> list[Any]:
    """A batch's caches as :class:`RaggedKVCache` (adopted in place; ``fixed``: see :meth:`RaggedKVCache.make_mask`)."""
    return [c if isinstance(c, RaggedKVCache) else RaggedKVCache.adopt(c, fixed) for c in caches]


def repeat_shapes() -> bool:
    """Whether passes over several positions should keep their shapes from step to step: on MLX's CUDA
    backend (cuDNN attention graphs are built per exact shape); elsewhere attention costs no build per shape and
    attending over a whole buffer would cost more than it saves."""
    return mx.default_device() == mx.gpu and bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def rollback(cache: Sequence[Any], drop: Sequence[int]) -> None:
    """Take ``drop[i]`` positions off the end of row ``i`` in a batch's ragged caches (no copy)."""
    if any(drop):
        for c in cache:
            c.retreat(drop)


class DraftModel:
    """A smaller model of the same vocabulary, with its own batched cache kept in step with the target's rows.

    Between steps a row's draft cache holds its tokens but the last (``fed[i]`` of them), so a step's first
    draft call feeds every row the same two tokens (its last and its pending one) in one forward pass."""

    def __init__(self, model: Any, prefill_step: int) -> None:
        self.model = model
        self.prefill_step = prefill_step
        self.cache: list[Any] = []
        self.fed: list[int] = []

    def joined(self, batch: SpecBatch, start: int) -> None:
        history = [list(t[:-1]) for t in batch.tokens[start:]]
        prefill = PromptProcessingBatch(self.model, list(range(len(history))),
                                        [make_prompt_cache(self.model) for _ in history],
                                        prefill_step_size=self.prefill_step)
        if any(history):
            prefill.prompt(history)
        self.cache = ragged(_extend_cache(self.cache, prefill.prompt_cache), batch.fixed_shapes)
        self.fed.extend(len(h) for h in history)

    def filter(self, keep: list[int]) -> None:
        self.fed = [self.fed[i] for i in keep]
        if not keep:
            self.cache = []
        else:
            for c in self.cache:
                c.filter(keep)

    def propose(self, batch: SpecBatch, pending: mx.array, k: int) -> mx.array:
        feeds = [t[f:] for t, f in zip(batch.tokens, self.fed)]
        n = len(feeds[0])
        if all(len(f) == n for f in feeds):
            inputs = mx.concatenate([mx.array(feeds, dtype=pending.dtype).reshape(len(feeds), n), pending[:, None]],
                                    axis=1)
            logits = self.model(inputs, cache=self.cache)[:, -1, :]
        else:  # rows joined or decoded plainly at different times: right-padded, the padding dropped after
            rows = [[*f, p] for f, p in zip(feeds, _ints(pending))]
            width = max(len(r) for r in rows)
            out = self.model(mx.array([r + [0] * (width - len(r)) for r in rows]), cache=self.cache)
            last = mx.array([len(r) - 1 for r in rows])[:, None, None]
            logits = mx.take_along_axis(out, last, axis=1)[:, 0, :]
            rollback(self.cache, [width - len(r) for r in rows])
        drafts = [mx.argmax(logits, axis=-1)]
        for _ in range(k - 1):
            drafts.append(mx.argmax(self.model(drafts[-1][:, None], cache=self.cache)[:, -1, :], axis=-1))
        self.fed = [len(t) + k for t in batch.tokens]  # its tokens, the pending one, k - 1 proposals
        return mx.stack(drafts, axis=1).astype(pending.dtype)

    def settle(self, accepted: list[int], k: int) -> None:
        # Keep all but the last kept token (see the class): of the k new positions, as many as it accepted.
        rollback(self.cache, [k - a for a in accepted])
        self.fed = [f - (k - a) for f, a in zip(self.fed, accepted)]

    def kv_bytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cache)


@dataclass(slots=True)
class _Lookup:
    """One row's n-grams: each maps to the position just after its latest earlier occurrence."""

    sizes: tuple[int, ...]
    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens whose n-grams ending before them are in ``seen``

    def add(self, tokens: list[int], pending: int) -> None:
        """Index ``tokens`` followed by ``pending`` (the next token, not in ``tokens`` yet)."""
        for end in range(max(self.indexed, 1), len(tokens) + 1):  # n-grams ending at end - 1, continued at end
            for n in self.sizes:
                if end >= n:
                    self.seen[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens) + 1)

    def follow(self, tokens: list[int], pending: int, k: int) -> list[int] | None:
        """What followed the longest suffix of ``tokens`` + ``pending`` seen before (padded to ``k``); None: no
        suffix was. Neither is copied: a row's tokens grow with every step."""
        for n in self.sizes:  # the longest suffix seen before wins
            if len(tokens) + 1 < n:
                continue
            at = self.seen.get((*tokens[len(tokens) - n + 1:], pending))
            if at is not None:
                found = tokens[at:at + k]
                if len(found) < k and at + len(found) == len(tokens):
                    found.append(pending)
                return found + [found[-1]] * (k - len(found))
        return None


class PromptLookup:
    """Proposals copied from the row's own prompt and output: what followed the latest earlier occurrence of
    its last few tokens (no draft model; pays where answers quote their input)."""

    def __init__(self, sizes: tuple[int, ...] = (4, 3, 2)) -> None:
        self.sizes = sizes
        self.rows: list[_Lookup] = []

    def joined(self, batch: SpecBatch, start: int) -> None:
        self.rows.extend(_Lookup(self.sizes) for _ in batch.tokens[start:])

    def filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def propose(self, batch: SpecBatch, pending: mx.array, k: int) -> mx.array | None:
        out, found = [], False
        for row, tokens, p in zip(self.rows, batch.tokens, _ints(pending)):
            row.add(tokens, p)
            follow = row.follow(tokens, p, k)
            found = found or follow is not None
            out.append(follow or [p] * k)  # a row with nothing seen: its pending token, rejected at no harm
        return mx.array(out, dtype=pending.dtype) if found else None

    def settle(self, accepted: list[int], k: int) -> None:
        return None

    def kv_bytes(self) -> int:
        return 0


@dataclass(slots=True)
class _Looks:
    """When a batch size's tuner next times a k other than its best."""

    every: int  # blocks between two looks
    due: int  # the block of the next look
    blocks: int = 0  # blocks chosen at this size
    best: int = 0
    taken: int = 0  # looks so far


class Tuner:
    """Chooses each step's ``k``: the one with the most tokens per second expected at the batch's size (to the
    nearest power of two), from the acceptance measured over every row (one rate per proposal position, as the
    usual analysis assumes) and the time a step of each ``k`` took at about as many rows, as so many plain steps
    timed lately (plain decoding is timed again when it has no timing within an eighth: on a CPU a row's share of
    a step still shrinks from 24 rows to 32). ``k`` holds for ``block`` steps and only a step that follows one of
    the same ``k`` is timed: a plain step's forward pass runs on while the next step starts, so the step after a
    change pays part of the one before. Every ``k`` is timed first, then the best is used, with plain decoding or
    a neighbour timed again one block in ``explore``. While plain decoding is best, a look at speculation comes in
    twice as many blocks as the last (up to ``explore * SPREAD``): a draft that sat out plain steps must catch up
    on every token since before it proposes again."""

    TRIES = 3  # timings of each k before the best is trusted
    KEEP = 4  # the latest timings of each k near a row count: their median is its step time (one slow step
    # moves nothing, and two blocks of it replace what a batch long gone measured)
    MARGIN = 1.15  # how much faster than plain decoding a k must look to be used
    SPREAD = 16

    def __init__(self, max_k: int, *, block: int = 4, explore: int = 8, budget: float = 0.01) -> None:
        self.ks = tuple(range(max_k + 1))
        self.block = block
        self.explore = explore
        # The share of the time that tries and looks at a k slower than plain decoding may lose: where a
        # verification costs many plain steps (a device that builds per shape, a compute-bound one), speculation
        # then costs at most that much over a worker's life (its first try aside).
        self.budget = budget
        self._seconds: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # (size, k) -> (rows, time per row)
        self._kept = 1.0  # proposals kept, and rejected (decayed sums): the acceptance rate is kept / both
        self._rejected = 1.0
        self._k = 0
        self._left = 0  # steps left in the current block
        self._looks: dict[int, _Looks] = {}  # per batch size
        self._elapsed = 0.0  # seconds of the steps timed
        self._lost = 0.0  # of them, lost by steps of a k to what plain decoding would have made in that time

    @property
    def acceptance(self) -> float:
        return self._kept / (self._kept + self._rejected)

    def choose(self, rows: int) -> int:
        if self._left <= 0:
            self._k, self._left = self._next(rows), self.block
        self._left -= 1
        return self._k

    def _next(self, rows: int) -> int:
        size = _size(rows)
        for k in self.ks:  # each k timed at this size first
            if len(self._seconds.get((size, k), ())) < self.TRIES:
                return k if not k or self._affordable() else 0
        if len(self._nearest(size, 0, rows)) < self.TRIES:  # plain decoding is timed at about this many rows
            return 0  # (no catch-up to pay)
        a = self.acceptance
        # Tokens a step of k makes per plain step's time; plain decoding makes one.
        gain = {k: sum(a ** j for j in range(k + 1)) / statistics.median(self._nearest(size, k, rows))
                for k in self.ks[1:]}
        best = max(gain, key=lambda k: gain[k], default=0)
        if best and gain[best] < self.MARGIN:  # a gain within the timings' noise is no gain
            best = 0
        looks = self._looks.setdefault(size, _Looks(self.explore, due=self.explore))
        looks.blocks += 1
        if best != looks.best:
            looks.best, looks.every, looks.due = best, self.explore, looks.blocks + self.explore
        if looks.blocks < looks.due:
            return best
        # Another k is timed again: plain decoding (what speculation must beat) every other time, else a neighbour.
        looks.due = looks.blocks + looks.every
        if best == 0:  # looking at speculation costs a catch-up; looking at plain decoding costs nothing more
            looks.every = min(looks.every * 2, self.explore * self.SPREAD)
        looks.taken += 1
        neighbours = [k for k in (best - 1, best + 1) if k in self.ks and k not in (0, best)]
        if best and (looks.taken % 2 or not neighbours):
            return 0
        look = neighbours[(looks.taken // 2) % len(neighbours)] if neighbours else best
        return look if look == best or self._affordable() else best

    def _affordable(self) -> bool:
        """Whether a try or look at speculation fits the budget of what such steps may lose."""
        return self._lost <= self.budget * self._elapsed

    def record(self, rows: int, k: int, seconds: float) -> None:
        """A step of ``k`` at ``rows`` rows took ``seconds``: plain decoding's kept per row, so that sizes rounded
        to the same power of two compare (a batch kept full moves between 31 and 32 rows); a proposing k's as so
        many plain steps at about as many rows, timed lately (a machine whose speed drifts moves both alike: a
        plain step timed slow must not make an older timing of a k look fast)."""
        size, cost = _size(rows), seconds / rows
        self._elapsed += seconds
        if k:
            plain = self._nearest(size, 0, rows) or self._ranked(size, 0, rows)
            if not plain:
                return
            cost /= statistics.median(plain)
            # What plain decoding would have made in this time, against what this step made; the block's first
            # step, never timed (it pays the change of k: a draft's catch-up), is taken to have lost as much.
            made = sum(self.acceptance ** j for j in range(k + 1))
            self._lost += max(0.0, seconds * (1 - made / cost)) * self.block / (self.block - 1)
        self._seconds.setdefault((size, k), deque(maxlen=4 * self.KEEP)).append((rows, cost))

    def _nearest(self, size: int, k: int, rows: int) -> list[float]:
        """Timings of ``k``: plain decoding's the latest at about ``rows`` rows (within an eighth, or one); a
        proposing k's the ``KEEP`` taken nearest ``rows`` (timing one again costs the draft a catch-up)."""
        if k:
            return self._ranked(size, k, rows)
        samples = self._seconds.get((size, k), ())
        return [t for r, t in samples if abs(r - rows) <= max(1, rows // 8)][-self.KEEP:]

    def _ranked(self, size: int, k: int, rows: int) -> list[float]:
        """The ``KEEP`` timings of ``k`` taken nearest ``rows`` rows, the latest first among equals."""
        samples = list(self._seconds.get((size, k), ()))
        ranked = sorted(range(len(samples)), key=lambda i: (abs(samples[i][0] - rows), -i))
        return [samples[i][1] for i in ranked[:self.KEEP]]

    def accepted(self, kept: Sequence[int], k: int) -> None:
        """Rows kept ``kept[i]`` of ``k`` proposals: each kept one a success, the first rejected a failure."""
        decay = 0.98  # recent steps count most: acceptance moves with what the batch generates
        self._kept = self._kept * decay + sum(kept)
        self._rejected = self._rejected * decay + sum(1 for a in kept if a < k)


class SpecBatch(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's generation batch, stepping speculatively when a proposal pays (see the module)."""

    proposer: Proposer
    tuner: Tuner
    stats: EngineStats
    _last: tuple[int, int, float] | None  # rows, k and start of the step being timed
    _untimed: int  # steps from the one being timed on that are no sample of their k (prompts, rows joined or left)
    _prior: int  # the k of the step before the one being timed (-1: none)
    fixed_shapes: bool  # passes over several positions keep their shapes (:func:`repeat_shapes`)

    @classmethod
    def make(cls, model: Any, sampler: Any, proposer: Proposer, tuner: Tuner, stats: EngineStats,
             fixed_shapes: bool | None = None) -> SpecBatch:
        batch: SpecBatch = cls.empty(model, sampler)
        batch.proposer, batch.tuner, batch.stats = proposer, tuner, stats
        batch.fixed_shapes = repeat_shapes() if fixed_shapes is None else fixed_shapes
        batch._last, batch._untimed, batch._prior = None, 0, -1
        return batch

    def extend(self, batch: Any) -> None:
        start = len(self.uids)
        self.untimed(2)  # the caches are joined lazily: the next step copies them
        super().extend(batch)
        self.prompt_cache = ragged(self.prompt_cache, self.fixed_shapes)
        self.proposer.joined(self, start)

    def filter(self, keep: list[int]) -> None:
        self.untimed(2)  # the caches are sliced lazily: the next step copies them
        super().filter(keep)
        self.proposer.filter(keep)
        if not keep:
            self._last = None  # what follows is idle time

    def untimed(self, steps: int = 1) -> None:
        """The step being timed, and ``steps - 1`` after it, are no sample of their ``k``."""
        self._untimed = max(self._untimed, steps)

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        takes = [_takes_proposals(s, self.fallback_sampler) for s in self.samplers or ()]  # may keep proposals
        rows, k = len(self.uids), self._choose(takes)
        self._time(time.perf_counter(), k)
        drafts = self.proposer.propose(self, self._next_tokens, k) if k else None
        if drafts is None:
            if k:  # nothing worth verifying: a plain step, a sample of this k's (one token a row, none proposed)
                self.tuner.accepted([0] * sum(takes), k)
            responses = super().next()
        else:
            responses = self._speculate(k, drafts, takes)
        self.stats.spec_k = k if drafts is not None else 0
        if self._last is not None:
            self._last = (rows, k, self._last[2])
        return responses  # type: ignore[no-any-return]

    def _time(self, now: float, k: int) -> None:
        """Record the step that ends now, if it was one of a run of the same ``k``; start timing the next."""
        if self._last is not None and not self._untimed and self._last[1] == k == self._prior:
            rows, _, start = self._last
            self.tuner.record(rows, k, now - start)
        self._prior = self._last[1] if self._last is not None else -1
        self._last, self._untimed = (0, k, now), max(0, self._untimed - 1)

    def _choose(self, takes: list[bool]) -> int:
        if any(self.logits_processors or ()):  # penalties and format masks run a row at a time: plain steps
            return 0
        if not any(takes):
            return 0
        return self.tuner.choose(len(self.uids))

    def _speculate(self, k: int, drafts: mx.array, takes: list[bool]) -> list[Any]:
        pending, pending_logprobs = self._next_tokens, self._next_logprobs
        logits = self.model(mx.concatenate([pending[:, None], drafts], axis=1), cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        choice = mx.argmax(logprobs, axis=-1)
        samplers = self.samplers or []
        greedy = [s is self.fallback_sampler for s in samplers]
        agree = (drafts == choice[:, :k]).astype(mx.int32)
        accepted = mx.where(mx.array(greedy), mx.cumprod(agree, axis=1).sum(axis=1), 0)
        following = mx.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
        if not all(greedy):
            accepted, following = self._sampled_rows(greedy, takes, samplers, logprobs, drafts, accepted, following)
        mx.eval(pending, drafts, accepted, following)
        kept = _ints(accepted)
        rollback(self.prompt_cache, [k - a for a in kept])
        self.proposer.settle(kept, k)
        self.tuner.accepted([a for a, t in zip(kept, takes) if t], k)
        self.stats.spec_steps += 1
        self.stats.spec_drafted += k * sum(takes)
        self.stats.spec_accepted += sum(kept)
        self._current_tokens, self._current_logprobs = pending, pending_logprobs  # type: ignore[assignment]
        self._next_tokens = following
        self._next_logprobs = [logprobs[i, a] for i, a in enumerate(kept)]
        return self._respond(_ints(pending), cast(list[list[int]], drafts.tolist()), kept, pending_logprobs, logprobs)

    def _sampled_rows(self, greedy: list[bool], takes: list[bool], samplers: list[Any], logprobs: mx.array,
                      drafts: mx.array, accepted: mx.array, following: mx.array) -> tuple[mx.array, mx.array]:
        """Rows with their own sampler: an unseeded one keeps proposals by the speculative-sampling rule, which
        draws exactly from its distribution; a seeded one draws from position 0 as a plain step does (its
        tokens must not depend on how many proposals a step made)."""
        kept, tokens = [], []
        for i, (g, t, s) in enumerate(zip(greedy, takes, samplers)):
            if g:
                kept.append(accepted[i])
                tokens.append(following[i])
            elif t:
                a, token = speculative_sample(s, logprobs[i], drafts[i])
                kept.append(a)
                tokens.append(token)
            else:
                kept.append(mx.array(0, dtype=accepted.dtype))
                tokens.append(s(logprobs[i:i + 1, 0])[0])
        return mx.stack(kept).astype(accepted.dtype), mx.stack(tokens).astype(following.dtype)

    def _count(self, i: int, tokens: list[int]) -> tuple[int, str | None]:
        """How many of ``tokens`` row ``i`` takes, and how the last one ends it: at max_tokens, or a stop token."""
        for n, token in enumerate(tokens, 1):
            self._num_tokens[i] += 1
            finish = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(token):
                finish = "stop"
            if finish is not None:
                return n, finish
        return len(tokens), None

    def _respond(self, pending: list[int], drafts: list[list[int]], kept: list[int], pending_logprobs: list[Any],
                 logprobs: mx.array) -> list[Any]:
        """Each row's tokens (its pending one and the proposals it kept), ended as mlx-lm's step ends them."""
        responses: list[Any] = []
        keep: list[int] = []
        for i, (uid, first, proposed, a) in enumerate(zip(self.uids, pending, drafts, kept)):
            tokens = [first, *proposed[:a]]
            n, finish = self._count(i, tokens)
            for j, token in enumerate(tokens[:n - 1]):
                responses.append(self.Response(uid, token, pending_logprobs[i] if j == 0 else logprobs[i, j - 1],
                                               None, None, None))
            last = pending_logprobs[i] if n == 1 else logprobs[i, n - 2]
            if finish is None:
                self.tokens[i].extend(tokens)
                responses.append(self.Response(uid, tokens[-1], last, None, None, None))
                keep.append(i)
                continue
            cache = self.extract_cache(i)
            for c in cache:
                c.trim(len(tokens) - n)  # the kept tokens after the one that ended it
            self.tokens[i].extend(tokens[:n])
            responses.append(self.Response(uid, tokens[n - 1], last, finish, cache, self.tokens[i]))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def speculative_sample(sampler: RowSampler, logprobs: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """The speculative-sampling rule for proposals made without a distribution of their own (a point mass at
    each): proposal ``j`` is kept with probability p_j(d_j) while all before it were; at the first rejected
    one the token is drawn from p_j without d_j (renormalised), after k kept ones from p_k. The tokens this
    yields are distributed exactly as the sampler's own draws. ``logprobs``: ``(k + 1, V)``; returns how many
    were kept and the token after them."""
    k = drafts.shape[0]
    probs = mx.softmax(sampler.logits(logprobs), axis=-1)
    p_draft = mx.take_along_axis(probs[:k], drafts[:, None].astype(mx.int32), axis=1)[:, 0]
    kept = mx.cumprod((mx.random.uniform(shape=(k,), key=sampler.key()) < p_draft).astype(mx.int32)).sum()
    row = mx.take(probs, kept, axis=0)
    rejected = mx.take(mx.concatenate([drafts.astype(mx.int32), mx.array([-1], dtype=mx.int32)]), kept)
    row = mx.where(mx.arange(row.shape[0]) == rejected, 0.0, row)
    return kept, mx.random.categorical(mx.log(row), key=sampler.key())


def _size(rows: int) -> int:
    """The power of two nearest ``rows`` (its exponent): batch sizes whose steps are timed together."""
    return round(math.log2(rows)) if rows > 0 else 0


def _takes_proposals(sampler: Any, greedy: Any) -> bool:
    """Whether a row may keep proposals: a greedy one, or one of an unseeded request's sampler."""
    return sampler is greedy or (isinstance(sampler, RowSampler) and not sampler.seeded)


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer (or boolean) array's values."""
    return [int(v) for v in cast(list[int], a.tolist())]
