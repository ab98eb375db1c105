"""What proposes a speculative step's tokens (an MLX adapter): a draft model, or the row's own prompt and
output (prompt lookup). Each follows the rows of a :class:`~engine.mlx.speculation.batch.SpecBatch`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from ..ragged_cache import _ints, forward, ragged, rollback

if TYPE_CHECKING:
    from .batch import SpecBatch

__all__ = ["DraftModel", "PromptLookup"]


class DraftModel:
    """A smaller model of the same vocabulary, with its own batched cache kept in step with the target's rows.

    Between steps a row's draft cache holds its tokens but the last (``fed[i]`` of them), so a step's first
    draft call feeds every row the same two tokens (its last and its pending one) in one forward pass.

    Where the batch's shapes repeat (:attr:`SpecBatch.fixed_shapes`), every pass over several positions is one of a
    few shapes: a joining row's history is prefilled in whole chunks of ``CHUNK`` (left-padded, through a cache
    whose keys are whole buffers), and what rows catch up on before proposing in chunks of a power of two."""

    CHUNK = 64  # positions of a pass over a row's history, where shapes repeat

    def __init__(self, model: Any, prefill_step: int) -> None:
        self.model = model
        self.prefill_step = prefill_step
        self.cache: list[Any] = []
        self.fed: list[int] = []

    def joined(self, batch: SpecBatch, start: int) -> None:
        history = [list(t[:-1]) for t in batch.tokens[start:]]
        if batch.fixed_shapes:
            caches = self._prefill(batch, history)
        else:
            prefill = PromptProcessingBatch(self.model, list(range(len(history))),
                                            [make_prompt_cache(self.model) for _ in history],
                                            prefill_step_size=self.prefill_step)
            if any(history):
                prefill.prompt(history)
            caches = prefill.prompt_cache
        self.cache = ragged(_extend_cache(self.cache, caches), batch.fixed_shapes, batch.most_rows)
        self.fed.extend(len(h) for h in history)

    def _prefill(self, batch: SpecBatch, history: list[list[int]]) -> list[Any]:
        """Each row's ``history`` in a cache of its own, fed in whole chunks (left-padded), attending over whole
        buffers: its passes' shapes depend on how many buffers of 256 it spans alone, not on its length."""
        out: list[Any] = []
        for h in history:
            pad = -len(h) % self.CHUNK
            cache = ragged([BatchKVCache([pad]) for _ in make_prompt_cache(self.model)], True, batch.most_rows)
            tokens = mx.array([[0] * pad + h], dtype=mx.uint32)
            for i in range(0, pad + len(h), self.CHUNK):
                self.model(tokens[:, i:i + self.CHUNK], cache=cache)
                batch.saw("draft-prefill", 1, self.CHUNK, int(cache[0].keys.shape[2]))
            mx.eval([c.state for c in cache])
            out = _extend_cache(out, cache)
        return out

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
        if batch.fixed_shapes:
            logits = self._catch_up(batch, [[*f, p] for f, p in zip(feeds, _ints(pending))])
        elif all(len(f) == n for f in feeds):
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
            drafts.append(mx.argmax(forward(self.model, drafts[-1][:, None], self.cache)[:, -1, :], axis=-1))
        self.fed = [len(t) + k for t in batch.tokens]  # its tokens, the pending one, k - 1 proposals
        return mx.stack(drafts, axis=1).astype(pending.dtype)

    def _catch_up(self, batch: SpecBatch, rows: list[list[int]]) -> mx.array:
        """Each row's logits after its tokens ``rows`` (what the draft has not seen, the pending one last), fed in
        passes of few shapes: the last pass over each row's last tokens, right-padded to a power of two (at most
        ``CHUNK``); what comes before them in whole chunks; each pass's padding taken off its row's end after it."""
        longest = max(len(r) for r in rows)
        width = min(1 << max(1, (longest - 1).bit_length()), self.CHUNK)
        heads = [r[:max(0, len(r) - width)] for r in rows]
        for i in range(0, max(len(h) for h in heads), self.CHUNK):
            self._pass(batch, [h[i:i + self.CHUNK] for h in heads], self.CHUNK)
        tails = [r[len(h):] for r, h in zip(rows, heads)]
        out = self._pass(batch, tails, width)
        last = mx.array([len(t) - 1 for t in tails])[:, None, None]
        return mx.take_along_axis(out, last, axis=1)[:, 0, :]

    def _pass(self, batch: SpecBatch, rows: list[list[int]], width: int) -> mx.array:
        """The draft over ``rows`` right-padded to ``width``, the padding taken off each row's end after it."""
        out = forward(self.model, mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.uint32), self.cache)
        held = self.cache[0]
        batch.saw("draft", len(held.ends), width, int(held.keys.shape[2]))
        rollback(self.cache, [width - len(r) for r in rows])
        return out

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
