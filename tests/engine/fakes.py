"""A fake continuous batch with a deterministic toy "model", for the scheduler's admission, priority and
preemption logic.

Each sequence's next token is a function of every token in its cache, as with greedy decoding; so a
sequence taken out and put back continues its stream exactly only if the scheduler hands back the right
cache and tokens, and a recompute only if it feeds the right prompt. Caches are :class:`ToyCache` records
of their length; the batch's KV bytes are what mlx-lm's batch cache allocates while it is step-aligned
(every row padded to the longest, in whole steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mlxq.engine.core.backend import BatchToken, SequenceCache, Started
from mlxq.engine.core.memory import KVBudget, KVLayout
from mlxq.engine.core.request import EngineRequest, RequestOutput, SamplingParams
from mlxq.engine.core.scheduler import Scheduler

LAYOUT = KVLayout(bytes_per_token=10, step=4)


def toy_next(tokens: list[int]) -> int:
    """The toy model: the next token of a sequence (never 0, so prompts of zeros stand out)."""
    return (sum(tokens) * 7 + len(tokens)) % 23 + 1


def toy_generate(prompt: list[int], n: int) -> list[int]:
    """What an uninterrupted run of the toy model generates."""
    tokens, out = list(prompt), []
    for _ in range(n):
        t = toy_next(tokens)
        tokens.append(t)
        out.append(t)
    return out


@dataclass(slots=True)
class ToyCache:
    """One layer's cache: how many tokens it holds."""

    offset: int
    trimmable: bool = True

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return self.offset * LAYOUT.bytes_per_token

    @property
    def state(self) -> tuple[()]:
        return ()


@dataclass(slots=True)
class _Row:
    tokens: list[int]
    left: int


@dataclass
class ToyBatch:
    """The fake batch; ``caches=False`` makes a backend that cannot hand out caches (like mlx-vlm's)."""

    caches: bool = True
    trimmable: bool = True
    kv_extra: int = 0  # added to kv_bytes(): an estimate that is wrong by this much
    rows: dict[int, _Row] = field(default_factory=dict)
    inserted: list[dict[str, Any]] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)  # start() calls
    calls: list[str] = field(default_factory=list)  # "start", "start_many <n>" and "take" (take_caches), in order
    steps: int = 0
    next_uid: int = 100
    checkpoints: list[SequenceCache] = field(default_factory=list)
    kv_seen: list[int] = field(default_factory=list)  # kv_bytes() after every step

    @property
    def supports_caches(self) -> bool:
        return self.caches

    def insert(self, prompt: list[int], max_tokens: int, sampler: Any, logits_processors: list[Any], *,
               cache: list[Any] | None = None, cache_tokens: list[int] | None = None, checkpoint: int = 0) -> int:
        if not prompt:
            raise ValueError("empty prompt")  # as mlx-lm
        before = list(cache_tokens or [])
        if cache is not None:
            assert cache[0].offset == len(before), "the cache must hold exactly the tokens said to be in it"
        uid = self.next_uid
        self.next_uid += 1
        self.inserted.append({"uid": uid, "prompt": list(prompt), "max_tokens": max_tokens, "cached": len(before),
                              "checkpoint": checkpoint})
        self.rows[uid] = _Row(before + list(prompt), max_tokens)
        if checkpoint:
            self.checkpoints.append(SequenceCache([ToyCache(len(before) + checkpoint)],
                                                  before + list(prompt[:checkpoint])))
        return uid

    def start(self, prompt: list[int], sampler: Any, logits_processors: list[Any], *,
              cache: list[Any] | None = None, cache_tokens: list[int] | None = None) -> Started:
        before = list(cache_tokens or [])
        if cache is not None:
            assert cache[0].offset == len(before), "the cache must hold exactly the tokens said to be in it"
        self.started.append({"prompt": list(prompt), "cached": len(before), "at_step": self.steps})
        self.calls.append("start")
        tokens = before + list(prompt)
        return Started(toy_next(tokens), None, [ToyCache(len(tokens), self.trimmable)])

    def start_many(self, prompts: list[list[int]], samplers: list[Any]) -> list[Started]:
        self.calls.append(f"start_many {len(prompts)}")
        return [self.start(p, s, []) for p, s in zip(prompts, samplers)]

    def remove(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self.rows.pop(uid, None)

    def take_caches(self, uids: Iterable[int]) -> dict[int, SequenceCache]:
        assert self.caches
        self.calls.append("take")
        out = {}
        for uid in uids:
            row = self.rows.pop(uid, None)
            if row is not None:
                out[uid] = SequenceCache([ToyCache(len(row.tokens), self.trimmable)], list(row.tokens))
        return out

    def take_checkpoints(self) -> list[SequenceCache]:
        out, self.checkpoints = self.checkpoints, []
        return out

    def kv_bytes(self) -> int:
        longest = max((len(r.tokens) for r in self.rows.values()), default=0)
        steps = -(-longest // LAYOUT.step)  # a batch's buffer, step-aligned when nothing unaligned came in
        return steps * LAYOUT.step * LAYOUT.bytes_per_token * len(self.rows) + self.kv_extra

    def step(self) -> list[BatchToken]:
        self.steps += 1
        out = []
        for uid, row in list(self.rows.items()):
            t = toy_next(row.tokens)
            row.tokens.append(t)  # the emitted token is fed in the same step (as in mlx-lm)
            row.left -= 1
            fin = "length" if row.left == 0 else None
            if fin is not None:
                del self.rows[uid]
                cache = [ToyCache(len(row.tokens))] if self.caches else None
                out.append(BatchToken(uid, t, fin, cache, list(row.tokens) if self.caches else None))
            else:
                out.append(BatchToken(uid, t, None))
        self.kv_seen.append(self.kv_bytes())
        return out

    def close(self) -> None:
        pass


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Detok:
    """Token id -> ``<id>``; the text since the last read."""

    def __init__(self) -> None:
        self._pending = ""

    def add_token(self, token: int) -> None:
        self._pending += f"<{token}>"

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        seg, self._pending = self._pending, ""
        return seg


def scheduler(batch: ToyBatch, capacity: int = 4, headroom: int | None = None, clock: Clock | None = None,
              **kw: Any) -> Scheduler:
    memory = KVBudget(headroom, LAYOUT) if headroom is not None else None
    return Scheduler(batch, capacity=capacity, new_detokenizer=Detok, clock=clock or Clock(), memory=memory, **kw)


def waiting(s: Scheduler) -> list[str]:
    """The ids of the scheduler's waiting requests, in queue order (``request_ids`` lists them before the running
    ones)."""
    ids = s.request_ids()
    return ids[: len(ids) - s.num_running]


def req(rid: str, prompt: list[int] | int = 3, max_tokens: int = 8, *, priority: int = 0, arrival: float = 0.0,
        **kw: Any) -> EngineRequest:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival=arrival, priority=priority, **kw)


@dataclass
class Run:
    """Every output of a scheduler, by request."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    started_order: list[str] = field(default_factory=list)

    def feed(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            self.outputs.setdefault(o.rid, []).append(o)
            if o.started:
                self.started_order.append(o.rid)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.token_ids]

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.outputs.get(rid, []))

    def final(self, rid: str) -> RequestOutput:
        (last,) = [o for o in self.outputs[rid] if o.finish is not None]
        return last

    def step(self, s: Scheduler, n: int = 1) -> None:
        for _ in range(n):
            self.feed(s.step())

    def drain(self, s: Scheduler, limit: int = 1000) -> None:
        for _ in range(limit):
            if not s.has_work:
                return
            self.feed(s.step())
        raise AssertionError("the scheduler did not finish its work")
