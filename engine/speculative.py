"""Speculative decoding inside mlx-lm's continuous batch.

A step proposes ``k`` tokens for every row (a draft model, or prompt lookup), scores all rows' ``k + 1``
positions in one forward pass of the target, and keeps each row's longest prefix of proposals equal to the
target's greedy choice plus the target's own next token. The KV positions a row rejected are rolled back in
both models' batched caches at once: trim what no row kept, then shift each row right by what it alone
rejected (its left padding grows, as after mlx-lm's ragged prefill). A row with its own sampler or logits
processors never takes a proposal, so its tokens are exactly plain decoding's; ``k`` is chosen per step from
the measured tokens per second of each ``k`` at the batch's size (0: plain decoding), so speculation turns
itself off where it does not pay.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .stats import EngineStats

__all__ = ["DraftModel", "PromptLookup", "SpecBatch", "SpecKind", "Speculation", "Tuner", "check_cache",
           "rollback"]


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

    def propose(self, batch: SpecBatch, pending: mx.array, k: int) -> mx.array:
        """``(B, k)`` proposals following each row's ``tokens`` and its pending token (``pending``, ``(B,)``)."""
        ...

    def settle(self, accepted: list[int], k: int) -> None:
        """Each row kept ``accepted[i]`` of its ``k`` proposals."""

    def kv_bytes(self) -> int: ...


def check_cache(model: Any) -> str | None:
    """Why ``model``'s KV cache cannot be rolled back per row (None: it can): only plain KV caches can."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
    return f"its KV cache ({', '.join(sorted(kinds))}) cannot be rolled back per row" if kinds else None


def rollback(cache: Sequence[Any], drop: Sequence[int]) -> None:
    """Take ``drop[i]`` positions off the end of row ``i`` in batched KV caches: trim what every row drops,
    then shift each row right by the rest (its left padding grows). The shift copies the cache, so it runs
    only when rows dropped different amounts."""
    least = min(drop)
    if least:
        for c in cache:
            c.trim(least)
    pad = [d - least for d in drop]
    if any(pad):
        for c in cache:
            c.prepare(right_padding=pad)
            c.finalize()


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
        self.cache = _extend_cache(self.cache, prefill.prompt_cache)
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
        else:  # rows joined or decoded plainly at different times: right-padded, as mlx-lm prefills
            rows = [[*f, p] for f, p in zip(feeds, _ints(pending))]
            width = max(len(r) for r in rows)
            pad = [width - len(r) for r in rows]
            for c in self.cache:
                c.prepare(right_padding=pad)
            out = self.model(mx.array([r + [0] * (width - len(r)) for r in rows]), cache=self.cache)
            last = mx.array([len(r) - 1 for r in rows])[:, None, None]
            logits = mx.take_along_axis(out, last, axis=1)[:, 0, :]
            for c in self.cache:
                c.finalize()
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

    def add(self, tokens: list[int]) -> None:
        for end in range(max(self.indexed, 1), len(tokens)):  # n-grams ending at end - 1, continued at end
            for n in self.sizes:
                if end >= n:
                    self.seen[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def follow(self, tokens: list[int], k: int) -> list[int]:
        for n in self.sizes:  # the longest suffix seen before wins
            at = self.seen.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if at is not None:
                found = tokens[at:at + k]
                return found + [found[-1]] * (k - len(found))
        return [tokens[-1]] * k


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

    def propose(self, batch: SpecBatch, pending: mx.array, k: int) -> mx.array:
        out = []
        for row, tokens, p in zip(self.rows, batch.tokens, _ints(pending)):
            history = [*tokens, p]
            row.add(history)
            out.append(row.follow(history, k))
        return mx.array(out, dtype=pending.dtype)

    def settle(self, accepted: list[int], k: int) -> None:
        return None

    def kv_bytes(self) -> int:
        return 0


@dataclass(slots=True)
class _Rate:
    tokens_per_s: float = 0.0
    seconds: float = 0.0  # per step
    samples: int = 0


class Tuner:
    """Chooses each step's ``k`` from the tokens per second each ``k`` measured at the batch's size (powers of
    two): every ``k`` is tried a few times, then the best is used, with a neighbour tried one step in
    ``explore`` so a change in acceptance or load is seen."""

    TRIES = 3

    def __init__(self, max_k: int, *, explore: int = 32, seed: int = 0) -> None:
        self.ks = tuple(range(max_k + 1))
        self.explore = explore
        self._rates: dict[tuple[int, int], _Rate] = {}
        self._steps = 0
        self._random = random.Random(seed)

    def choose(self, rows: int) -> int:
        size = rows.bit_length()
        rates = [self._rates.get((size, k)) for k in self.ks]
        for k, rate in zip(self.ks, rates):
            if rate is None or rate.samples < self.TRIES:
                return k
        best = max(self.ks, key=lambda k: rates[k].tokens_per_s)  # type: ignore[union-attr]
        self._steps += 1
        if self._steps % self.explore == 0:
            return max(0, min(self.ks[-1], best + self._random.choice((-1, 1))))
        return best

    def record(self, rows: int, k: int, tokens: int, seconds: float) -> None:
        rate = self._rates.setdefault((rows.bit_length(), k), _Rate())
        if rate.samples >= self.TRIES and seconds > 4 * rate.seconds:
            return  # an idle wait or a stall between steps, not this k's cost
        w = 1.0 / (rate.samples + 1) if rate.samples < self.TRIES else 0.2
        rate.tokens_per_s += (tokens / seconds - rate.tokens_per_s) * w
        rate.seconds += (seconds - rate.seconds) * w
        rate.samples += 1


class SpecBatch(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's generation batch, stepping speculatively when a proposal pays (see the module)."""

    proposer: Proposer
    tuner: Tuner
    stats: EngineStats
    _last: tuple[int, int, int, float] | None  # rows, k, tokens and start of the step being timed
    _untimed: bool  # the step being timed also prefilled prompts: not a sample of its k

    @classmethod
    def make(cls, model: Any, sampler: Any, proposer: Proposer, tuner: Tuner, stats: EngineStats) -> SpecBatch:
        batch: SpecBatch = cls.empty(model, sampler)
        batch.proposer, batch.tuner, batch.stats = proposer, tuner, stats
        batch._last, batch._untimed = None, False
        return batch

    def extend(self, batch: Any) -> None:
        start = len(self.uids)
        super().extend(batch)
        self.proposer.joined(self, start)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self.proposer.filter(keep)
        if not keep:
            self._last = None  # what follows is idle time

    def untimed(self) -> None:
        self._untimed = True

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        self._time(time.perf_counter())
        rows, k = len(self.uids), self._choose()
        responses = super().next() if k == 0 else self._speculate(k)
        self.stats.spec_k = k
        if self._last is not None:
            self._last = (rows, k, len(responses), self._last[3])
        return responses  # type: ignore[no-any-return]

    def _time(self, now: float) -> None:
        if self._last is not None and not self._untimed:
            rows, k, tokens, start = self._last
            self.tuner.record(rows, k, tokens, now - start)
        self._last, self._untimed = (0, 0, 0, now), False

    def _choose(self) -> int:
        if any(self.logits_processors or ()):  # penalties and format masks run a row at a time: plain steps
            return 0
        if not any(s is self.fallback_sampler for s in self.samplers or ()):  # no greedy row would take a proposal
            return 0
        return self.tuner.choose(len(self.uids))

    def _speculate(self, k: int) -> list[Any]:
        pending, pending_logprobs = self._next_tokens, self._next_logprobs
        drafts = self.proposer.propose(self, pending, k)
        logits = self.model(mx.concatenate([pending[:, None], drafts], axis=1), cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        choice = mx.argmax(logprobs, axis=-1)
        samplers = self.samplers or []
        greedy = mx.array([s is self.fallback_sampler for s in samplers])
        agree = (drafts == choice[:, :k]).astype(mx.int32)
        accepted = mx.where(greedy, mx.cumprod(agree, axis=1).sum(axis=1), 0)
        following = mx.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]
        if not mx.all(greedy).item():  # rows with their own sampler draw from position 0, as a plain step does
            drawn = [following[i:i + 1] if g else s(logprobs[i:i + 1, 0])
                     for i, (g, s) in enumerate(zip(_ints(greedy), samplers))]
            following = mx.concatenate(drawn).astype(following.dtype)
        mx.eval(pending, drafts, accepted, following)
        kept = _ints(accepted)
        rollback(self.prompt_cache, [k - a for a in kept])
        self.proposer.settle(kept, k)
        self.stats.spec_steps += 1
        self.stats.spec_drafted += k * sum(_ints(greedy))
        self.stats.spec_accepted += sum(kept)
        self._current_tokens, self._current_logprobs = pending, pending_logprobs  # type: ignore[assignment]
        self._next_tokens = following
        self._next_logprobs = [logprobs[i, a] for i, a in enumerate(kept)]
        return self._respond(_ints(pending), cast(list[list[int]], drafts.tolist()), kept, pending_logprobs, logprobs)

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


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer (or boolean) array's values."""
    return [int(v) for v in cast(list[int], a.tolist())]
