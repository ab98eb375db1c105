"""Speculative decoding inside mlx-lm's continuous batch.

A step proposes ``k`` tokens for every row (a draft model, or prompt lookup), scores all rows' ``k + 1``
positions in one forward pass of the target, and keeps each row's prefix of proposals the target agrees with
(greedy rows: its argmax; unseeded sampled rows: the speculative-sampling rule) plus the target's own next
token. A row takes the positions it rejected off its own end in both models' caches, without moving the others
(``engine/mlx/ragged_cache.py``). Seeded, penalised and constrained rows take no proposals, so their tokens are
exactly plain decoding's; ``k`` is chosen per step from the measured acceptance and step times (0: plain
decoding), so speculation turns itself off where it does not pay (``engine/core/speculation/tuner.py``, which
imports no MLX; which steps time their k is ``engine/core/speculation/timing.py``'s). The proposers are
``proposers.py``."""

from __future__ import annotations

import time
from typing import Any, Protocol, cast

import mlx.core as mx

from ...core.speculation.timing import StepTimer
from ...core.speculation.tuner import Tuner
from ...core.stats import EngineStats
from ..generation import MaskedGenerationBatch
from ..ragged_cache import HeldRows, RaggedKVCache, _ints, ragged, repeat_shapes, rollback
from ..sampling import RowSampler

__all__ = ["Proposer", "SpecBatch", "speculative_sample"]


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


class SpecBatch(MaskedGenerationBatch):
    """mlx-lm's generation batch (its constrained rows masked at once, ``engine/mlx/generation.py``), stepping
    speculatively when a proposal pays (see the module)."""

    proposer: Proposer
    tuner: Tuner
    timer: StepTimer  # which steps are samples of their k
    stats: EngineStats
    fixed_shapes: bool  # passes over several positions keep their shapes (:func:`repeat_shapes`)
    most_rows: int  # the batch's capacity (where shapes repeat, the caches hold rows in buckets up to it)
    shapes: set[tuple[str, int, int, int]]  # (pass, rows held, positions, keys) of passes over several positions
    SHAPES_KEPT = 4096  # where shapes do not repeat (elsewhere than CUDA) nearly every pass has its own: a bound

    @classmethod
    def make(cls, model: Any, sampler: Any, proposer: Proposer, tuner: Tuner, stats: EngineStats,
             fixed_shapes: bool | None = None, most_rows: int = 0) -> SpecBatch:
        batch: SpecBatch = cls.empty(model, sampler)
        batch.proposer, batch.tuner, batch.timer, batch.stats = proposer, tuner, StepTimer(tuner), stats
        batch.fixed_shapes = repeat_shapes() if fixed_shapes is None else fixed_shapes
        batch.most_rows = most_rows
        if batch.fixed_shapes:  # the caches hold rows in buckets: every pass feeds them all
            batch.model = HeldRows(model)  # type: ignore[assignment]  # mlx-lm calls it as its model
        batch.shapes = set()
        return batch

    def extend(self, batch: Any) -> None:
        start = len(self.uids)
        self.timer.untimed(2)  # the caches are joined lazily: the next step copies them
        super().extend(batch)
        self.prompt_cache = ragged(self.prompt_cache, self.fixed_shapes, self.most_rows)
        self.proposer.joined(self, start)

    def filter(self, keep: list[int]) -> None:
        self.timer.untimed(2)  # the caches are sliced lazily: the next step copies them
        super().filter(keep)
        self.proposer.filter(keep)
        if not keep:
            self.timer.idle()  # what follows is idle time

    def prompted(self) -> None:
        """The step being timed spans prompt work: neither a sample of its ``k`` nor charged to it."""
        self.timer.prompted()

    def saw(self, kind: str, rows: int, positions: int, keys: int) -> None:
        """A pass over several positions had this shape: a new one, where shapes repeat, makes its step no sample
        (on CUDA it built a cuDNN graph, a cost paid once; the step is charged to its k)."""
        shape = (kind, rows, positions, keys)
        if shape not in self.shapes and len(self.shapes) < self.SHAPES_KEPT:
            self.shapes.add(shape)
            if self.fixed_shapes:
                self.timer.built()

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        takes = [_takes_proposals(s, self.fallback_sampler) for s in self.samplers or ()]  # may keep proposals
        rows, k = len(self.uids), self._choose(takes)
        self.timer.start(time.perf_counter(), rows, k)
        drafts = self.proposer.propose(self, self._next_tokens, k) if k else None
        if drafts is None:
            if k:  # nothing worth verifying: a plain step, a sample of this k's (one token a row, none proposed)
                self.tuner.accepted([0] * sum(takes), k)
            responses = super().next()
        else:
            responses = self._speculate(k, drafts, takes)
        self.stats.spec_k = k if drafts is not None else 0
        self.timer.shaped(self._shape())
        return responses  # type: ignore[no-any-return]

    def _shape(self) -> tuple[int, int, bool]:
        """The shape the step just run (or, for a plain one, the pass it started) ran in: the rows the caches hold,
        their buffers' steps (mlx-lm grows a buffer 256 positions at a time), and whether rows end apart (a ragged
        cache writes and masks another way)."""
        held = self.prompt_cache[0] if self.prompt_cache else None
        if not isinstance(held, RaggedKVCache):
            return 0, 0, False
        return len(held.ends), -(-held.width() // held.step), not held._even

    def _choose(self, takes: list[bool]) -> int:
        if any(self.logits_processors or ()):  # penalties and format masks run a row at a time: plain steps
            return 0
        if not any(takes):
            return 0
        return self.tuner.choose(len(self.uids))

    def _speculate(self, k: int, drafts: mx.array, takes: list[bool]) -> list[Any]:
        pending, pending_logprobs = self._next_tokens, self._next_logprobs
        logits = self.model(mx.concatenate([pending[:, None], drafts], axis=1), cache=self.prompt_cache)
        held = self.prompt_cache[0]
        self.saw("verify", len(held.ends), k + 1, held.width() if held.fixed else held._idx)
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


def _takes_proposals(sampler: Any, greedy: Any) -> bool:
    """Whether a row may keep proposals: a greedy one, or one of an unseeded request's sampler."""
    return sampler is greedy or (isinstance(sampler, RowSampler) and not sampler.seeded)
