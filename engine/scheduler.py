"""The continuous-batching scheduler: admit waiting requests, step the batch, turn tokens into outputs.

It knows nothing of Redis, asyncio or threads, so tests drive it step by step with a fake backend.
The engine calls it only from the model's MLX thread.

Admission, before each step: waiting requests leave in priority order with aging (``waiting.py``), and the
first that cannot join holds back those behind it. A request joins when a sequence slot is free and, with
a :class:`~engine.memory.KVBudget`, when the batch's KV caches stay under the headroom until it ends: every
row is charged as long as the longest row may grow (``memory.py``), preempted caches held are charged too,
and so is any excess of the caches' measured bytes over that estimate (a wrong estimate cannot run away).
A request that could never fit ends at once with ``error(bad_request)``.

Preemption (as vLLM's, without its priority inversion: slots count as well as memory): when the first
waiting request cannot join, running sequences of strictly lower priority whose own key is no better than
its (aging protects them) leave the batch, lowest priority and latest first, as few as make room. With a
backend that hands out caches, a preempted sequence keeps its KV cache and later resumes exactly where it
was (the cache trimmed by one token, the last token fed again: ENGINE-NOTES 1.5); otherwise, or when only
dropping caches makes room, it resumes by prefilling its prompt plus the tokens it generated. Either way
its detokenizer, stop matcher and count carry on: its output continues without a gap or a repeat.

Prefix cache (``prefix_cache.py``): each prompt starts from the longest cached prefix of it; a request's
system-prompt prefix is cached as its prefill passes it, a finished sequence's whole cache when it ends.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from .batch import BatchBackend, BatchToken, CachingBackend, GeneratedToken, SequenceCache
from .memory import KVBudget, mib
from .prefix_cache import PrefixCache
from .request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from .stats import EngineStats
from .stops import StopMatcher
from .waiting import WaitingQueue, priority_key

__all__ = ["Detokenizer", "Room", "Scheduler", "StepFailed"]

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """The batch failed mid-step; ``outputs`` are what the step had already decided (emit them first)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__(f"step failed after {len(outputs)} outputs")
        self.outputs = outputs


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface (one instance per sequence)."""

    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Room:
    """What the batch can still take, as of the last step (other threads read it: replaced whole)."""

    free_slots: int  # sequence slots not running
    waiting: int  # requests waiting for one (preempted ones included)
    kv_rows: int  # more typical requests the KV headroom has room for beside the running ones
    # The lowest priority running, while no request that has not started yet waits: a new request of higher
    # priority would start at once (preempting) even with no room. None otherwise.
    outranked: int | None = None

    @property
    def admissible(self) -> int:
        """Requests that could join soon: free slots (bounded by KV room) not already promised to waiting ones."""
        return max(0, min(self.free_slots, self.kv_rows) - self.waiting)


@dataclass(slots=True, eq=False)
class _Sequence:
    req: EngineRequest
    detok: Detokenizer
    stops: StopMatcher | None  # None without stop strings
    key: float  # waiting-queue key (lower first)
    order: int  # first come, first served within a key
    end: int  # the most tokens its cache can hold: prompt + max_tokens
    uid: int = -1  # in the batch; -1 while waiting
    generated: int = 0
    admitted: bool = False  # has started (a later admission is a resume)
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    history: list[int] | None = None  # the generated tokens, kept once they may be needed for a recompute
    held: SequenceCache | None = None  # its KV cache while preempted
    held_bytes: int = 0


@dataclass(slots=True)
class _StepOutputs:
    """Outputs of one step, one record per request."""

    by_rid: dict[str, RequestOutput] = field(default_factory=dict)

    def get(self, rid: str) -> RequestOutput:
        out = self.by_rid.get(rid)
        if out is None:
            out = self.by_rid[rid] = RequestOutput(rid)
        return out


class Scheduler:
    """Runs requests through a :class:`BatchBackend` of at most ``capacity`` sequences.

    ``memory``: admit by KV bytes (None: by slots only). ``prefix_cache``: reuse cached prompt prefixes (only
    with a backend that supports caches). ``aging_s``: seconds of waiting worth one priority level.
    ``context_length``: requests longer than this are refused.
    """

    def __init__(
        self,
        backend: BatchBackend,
        *,
        capacity: int,
        new_detokenizer: Callable[[], Detokenizer],
        make_sampler: Callable[[SamplingParams], Any] = lambda p: None,
        make_processors: Callable[[SamplingParams], list[Any]] = lambda p: [],
        clock: Callable[[], float] = time.monotonic,
        memory: KVBudget | None = None,
        prefix_cache: PrefixCache | None = None,
        aging_s: float = 1.0,
        context_length: int | None = None,
        stats: EngineStats | None = None,
    ) -> None:
        self.capacity = capacity
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.aging_s = aging_s
        self.context_length = context_length
        self.stats = stats if stats is not None else EngineStats()
        self.stats.kv_headroom_bytes = memory.headroom if memory is not None else 0
        self._new_detokenizer = new_detokenizer
        self._make_sampler = make_sampler
        self._make_processors = make_processors
        self._clock = clock
        self._waiting: WaitingQueue[_Sequence] = WaitingQueue()
        self._running: dict[int, _Sequence] = {}
        self._uid_of: dict[str, int] = {}
        self._rejected: list[RequestOutput] = []  # refused by add(): reported by the next step
        self._next_deadline = math.inf  # no request's deadline is earlier (it may be a gone request's)
        self._orders = itertools.count()
        self._priorities: Counter[int] = Counter()  # running sequences per priority
        self._longest: int | None = 0  # the largest ``end`` running (None: to recompute)
        self._held_bytes = 0  # caches of preempted sequences
        self._measured = 0  # the backend's KV bytes at the last reading
        self._measured_stale = True
        self._finished: list[SequenceCache] = []  # caches of sequences that ended this step, for the prefix cache
        # A preemption left for the start of the next step: (the request it made room for, victims, hold).
        self._deferred: tuple[_Sequence, list[_Sequence], bool] | None = None
        self._typical_end = 0.0  # running mean of admitted requests' ``end`` (for Room)
        self.backend = backend
        self.room = Room(capacity, 0, capacity)
        self._update_room()  # what the KV headroom allows, before the first step

    # --- state -------------------------------------------------------------------------------------
    @property
    def backend(self) -> BatchBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: BatchBackend) -> None:
        """Use ``backend`` (a new one after a failure): what it can do decides the cache features."""
        self._backend = backend
        caching = bool(getattr(backend, "supports_caches", False))
        self._caching = cast(CachingBackend, backend) if caching else None
        self._prefix = self.prefix_cache if caching else None
        self._kv_probe: Callable[[], int] | None = getattr(backend, "kv_bytes", None)
        self._measured_stale = True

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._rejected)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def request_ids(self) -> list[str]:
        return [r.rid for r in self.requests()]

    def requests(self) -> list[EngineRequest]:
        return [s.req for s in self._waiting] + [s.req for s in self._running.values()]

    # --- commands ----------------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Queue a request; it joins the batch at a step with room for it (or is refused at the next step)."""
        problem = self._never_fits(req)
        if problem is not None:
            self.stats.rejected_too_large += 1
            log.info("request %s refused: %s", req.rid, problem)
            self._rejected.append(_terminal(req.rid, FinishReason.ERROR, "bad_request", problem, 0))
            return
        arrival = req.arrival or self._clock()
        seq = _Sequence(req, self._new_detokenizer(), StopMatcher(req.params.stop) if any(req.params.stop) else None,
                        priority_key(arrival, req.priority, self.aging_s), next(self._orders),
                        len(req.prompt_tokens) + req.params.max_tokens)
        self._waiting.push(req.rid, seq.key, seq.order, seq)
        self._room_dirty = True
        if req.deadline is not None:
            self._next_deadline = min(self._next_deadline, req.deadline)

    def abort(
        self, rid: str, reason: FinishReason = FinishReason.CANCELLED, code: str | None = None, message: str = ""
    ) -> RequestOutput | None:
        """Remove a request wherever it is (its memory freed); its terminal output, or None for an unknown id."""
        seq = self._pop_running(rid)
        if seq is not None:
            self.backend.remove([seq.uid])
            self._read_kv()
        else:
            seq = self._waiting.remove(rid)
            if seq is None:
                return None
            self._release(seq)
        self._room_dirty = True
        self._update_room()
        return _terminal(rid, reason, code, message, seq.generated)

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Fail every request (the batch is unusable); the caller replaces the backend."""
        outs = [_terminal(s.req.rid, FinishReason.ERROR, code, message, s.generated) for s in self._running.values()]
        outs += [_terminal(s.req.rid, FinishReason.ERROR, code, message, s.generated) for s in self._waiting]
        outs += self._rejected
        self._running.clear()
        self._uid_of.clear()
        self._waiting.clear()
        self._deferred = None
        self._rejected = []
        self._priorities.clear()
        self._longest, self._held_bytes, self._finished = 0, 0, []
        if self.prefix_cache is not None:  # memory may be what failed
            self.prefix_cache.clear()
            self._sync_prefix_stats()
        self._measured, self._measured_stale = 0, False  # not a reading: the failed batch is not asked again
        self.stats.kv_bytes = self.stats.kv_reserved_bytes = 0
        self._room_dirty = True
        self._update_room()
        return outs

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Expire deadlines, admit waiting requests, run one batch step, report per request."""
        outs = _StepOutputs()
        if self._rejected:
            for out in self._rejected:
                outs.by_rid[out.rid] = out
            self._rejected = []
        self._expire(outs)
        if self._deferred is not None:
            self._preempt_deferred()
        started_at_once = self._admit(outs)
        if self._running:
            # A request started at once (see _admit) has its first token: it goes out now, not after a decode.
            if not started_at_once:
                try:
                    tokens = self.backend.step()
                except Exception as exc:
                    raise StepFailed(list(outs.by_rid.values())) from exc
                for tok in tokens:
                    self._on_token(tok, outs)
            self._after_step()
        if self._room_dirty:
            self._update_room()
        return list(outs.by_rid.values())

    def _expire(self, outs: _StepOutputs) -> None:
        now = self._clock()
        if now <= self._next_deadline:  # the common case: no scan of every request each step
            return
        late: list[str] = []
        self._next_deadline = math.inf
        for r in self.requests():
            if r.deadline is None:
                continue
            if now > r.deadline:
                late.append(r.rid)
            else:
                self._next_deadline = min(self._next_deadline, r.deadline)
        for rid in late:
            out = self.abort(rid, FinishReason.ERROR, "timeout", "the job ran past its deadline")
            if out is not None:
                outs.by_rid[rid] = out

    def _on_token(self, tok: GeneratedToken, outs: _StepOutputs) -> None:
        seq = self._running.get(tok.uid)
        if seq is None:  # removed since the step began
            return
        out = outs.get(seq.req.rid)
        fin = tok.finish_reason
        if fin is not None:
            if self._prefix is not None and len(seq.req.prompt_tokens) >= self._prefix.min_tokens:
                self._keep_final_cache(tok)
            if fin == "stop":  # EOS: not part of the text (as mlx_lm.generate)
                self._finish(seq, out, FinishReason.STOP, removed=True)
                return
        seq.generated += 1
        if seq.history is not None:
            seq.history.append(tok.token)
        out.token_ids.append(tok.token)
        out.completion_tokens = seq.generated
        seq.detok.add_token(tok.token)
        if _take_text(seq, out):
            self._finish(seq, out, FinishReason.STOP, removed=False, flush=False)
        elif fin == "length":
            self._finish(seq, out, FinishReason.LENGTH, removed=True)

    def _finish(
        self, seq: _Sequence, out: RequestOutput, reason: FinishReason, *, removed: bool, flush: bool = True
    ) -> None:
        if flush:
            seq.detok.finalize()
            if _take_text(seq, out):
                reason = FinishReason.STOP
            elif seq.stops is not None:
                out.text += seq.stops.flush()
        if not removed:
            if (self._prefix is not None and self._caching is not None
                    and len(seq.req.prompt_tokens) >= self._prefix.min_tokens):
                self._finished.extend(self._caching.take_caches([seq.uid]).values())
            else:
                self.backend.remove([seq.uid])
        self._pop_running(seq.req.rid)
        out.finish, out.completion_tokens = reason, seq.generated

    def _after_step(self) -> None:
        if self._prefix is not None:
            self._store_caches()
        self._read_kv()

    def _read_kv(self) -> None:
        """Read the batch's KV bytes (on the engine thread, after every step and removal: never stale)."""
        if self._kv_probe is None:
            return
        self._measured = self._kv_probe()
        self._measured_stale = False
        used = self._measured + self._held_bytes
        stats = self.stats
        stats.kv_bytes = used
        if used > stats.kv_bytes_peak:
            stats.kv_bytes_peak = used

    # --- admission ---------------------------------------------------------------------------------
    def _never_fits(self, req: EngineRequest) -> str | None:
        """Why ``req`` can never run here (beyond the context, or its KV alone beyond the headroom), or None."""
        p, m = len(req.prompt_tokens), req.params.max_tokens
        ctx = self.context_length
        if ctx is not None and p + m > ctx:
            return f"prompt ({p} tokens) + max_tokens ({m}) exceeds the context ({ctx}) by {p + m - ctx} tokens"
        if self.memory is not None:
            need, room = self.memory.batch_bytes(1, p + m), self.memory.headroom
            if need > room:
                return (f"prompt ({p} tokens) + max_tokens ({m}) needs {mib(need)} of KV cache, {mib(need - room)} "
                        f"more than this worker's KV headroom ({mib(room)})")
        return None

    def _admit(self, outs: _StepOutputs) -> int:
        """Admit waiting requests in order; how many of them started at once (their first token is out)."""
        at_once = 0
        while self._waiting:
            seq = self._waiting.peek()
            assert seq is not None
            urgent = self._outranks_running(seq)
            plan = None
            if not self._fits(seq):
                plan = self._plan_preemption(seq)
                if plan is None:
                    if not self._drop_held_caches(seq):
                        return at_once
                elif not (urgent and self._fits(seq, slots=False)):
                    self._preempt(seq, *plan)
                    plan = None
            self._waiting.remove(seq.req.rid)  # not pop(): a preempted sequence may share its key
            at_once += self._launch(seq, outs, urgent)
            if plan is not None and seq.req.rid in self._uid_of:
                # Only a slot was short: the victims leave at the start of the next step, so its first token,
                # out with this step's outputs, does not wait for their caches to be copied out of the batch.
                self._deferred = (seq, *plan)
                return at_once
        return at_once

    def _preempt_deferred(self) -> None:
        assert self._deferred is not None
        top, victims, hold = self._deferred
        self._deferred = None
        if self._running.get(top.uid) is not top:  # aborted since it started: the batch has its slot back
            return
        still = [v for v in victims if self._running.get(v.uid) is v]  # none ended in between, but may be aborted
        if still:
            self._preempt(top, still, hold)

    def _drop_held_caches(self, top: _Sequence) -> bool:
        """Let ``top`` join by dropping caches held by other waiting sequences (they resume by recomputing
        instead), lowest priority and latest first; whether it can join now. Without this, caches held for
        sequences queued behind ``top`` could keep it out of an idle batch for good."""
        if self._held_bytes == top.held_bytes or not self._fits(top, drop_held=True):
            return False
        others = sorted((s for s in self._waiting if s.held is not None and s is not top),
                        key=lambda s: (s.req.priority, -s.key, -s.order))
        for s in others:
            log.info("request %s drops its held cache (%d bytes; it will recompute) for request %s",
                     s.req.rid, s.held_bytes, top.req.rid)
            self._release(s)
            if self._fits(top):
                return True
        return False

    def _outranks_running(self, seq: _Sequence) -> bool:
        """Whether ``seq`` starts at once: a new request of higher priority than some running sequence is
        prefilled on its own before the next decode step, its first token sampled from that prefill (in
        mlx-lm's batch a joining prompt waits for three decode steps of the whole batch)."""
        return (self._caching is not None and not seq.admitted and seq.req.images is None
                and bool(self._priorities) and min(self._priorities) < seq.req.priority)

    def _fits(self, seq: _Sequence, victims: Sequence[_Sequence] = (), hold: bool = False, slots: bool = True,
              drop_held: bool = False) -> bool:
        """Whether ``seq`` can join once ``victims`` left (holding their caches if ``hold``); ``slots=False``:
        whether the KV headroom has room for it beside every running sequence, whatever the slots;
        ``drop_held``: whether it could once the other waiting sequences' held caches were dropped."""
        rows = len(self._running) - len(victims)
        if slots and rows >= self.capacity:
            return False
        mem = self.memory
        if mem is None:
            return True
        longest = max(seq.end, self._max_end(victims))
        held = 0 if drop_held else self._held_bytes - seq.held_bytes
        if hold:
            held += sum(self._cache_estimate(v) for v in victims)
        return mem.batch_bytes(rows + 1, longest) + held + self._excess() <= mem.headroom

    def _max_end(self, without: Sequence[_Sequence] = ()) -> int:
        if without:
            return max((s.end for s in self._running.values() if s not in without), default=0)
        if self._longest is None:
            self._longest = max((s.end for s in self._running.values()), default=0)
        return self._longest

    def _cache_estimate(self, seq: _Sequence) -> int:
        """Bytes of ``seq``'s cache once taken out of the batch (an exact-length copy)."""
        assert self.memory is not None
        return self.memory.layout.cache_bytes(len(seq.req.prompt_tokens) + seq.generated)

    def _excess(self) -> int:
        """How far the caches' measured bytes exceed the estimate for the running sequences (0 normally)."""
        mem = self.memory
        if mem is None or self._kv_probe is None:
            return 0
        if self._measured_stale:  # the batch changed since the last step: never judge by a stale figure
            self._measured, self._measured_stale = self._kv_probe(), False
        return max(0, self._measured - mem.batch_bytes(len(self._running), self._max_end()))

    def _launch(self, seq: _Sequence, outs: _StepOutputs, at_once: bool = False) -> int:
        """Insert ``seq`` into the batch: a new request, or a preempted one resuming. ``at_once``: prefill it
        alone first (:meth:`_start`). Returns 1 if it started at once, else 0."""
        req = seq.req
        resumed = seq.admitted
        if not resumed:
            seq.sampler, seq.processors = self._make_sampler(req.params), self._make_processors(req.params)
            if self._caching is None:  # no cache to resume from: a preemption recomputes from the tokens
                seq.history = []
        first: BatchToken | None = None
        try:
            if at_once:
                uid, first = self._start(seq)
            else:
                uid = self._insert(seq)
        except ValueError as exc:
            self._release(seq)
            outs.by_rid[req.rid] = _terminal(req.rid, FinishReason.ERROR, "bad_request", str(exc), seq.generated)
            return 0
        except Exception as exc:
            self._waiting.push(req.rid, seq.key, seq.order, seq)  # still owned here, so fail_all() reaches it
            raise StepFailed(list(outs.by_rid.values())) from exc
        seq.uid, seq.admitted = uid, True
        self._running[uid] = seq
        self._uid_of[req.rid] = uid
        self._priorities[req.priority] += 1
        if self._longest is not None and seq.end > self._longest:
            self._longest = seq.end
        self._measured_stale = self._room_dirty = True
        self._reserve()
        if not resumed:
            out = outs.get(req.rid)
            out.started, out.prompt_tokens = True, len(req.prompt_tokens)
            self._typical_end += (seq.end - self._typical_end) / (8 if self._typical_end else 1)
        if first is None:
            return 0
        if first.finish_reason is not None:  # it ended with its first token: it leaves the batch unstarted
            self.backend.remove([uid])
        self._on_token(first, outs)
        return 1

    def _start(self, seq: _Sequence) -> tuple[int, BatchToken]:
        """Prefill ``seq`` alone (from its longest cached prefix) and sample its first token, then put it in
        the batch holding that cache, to go on from the first token: as a preempted sequence resumes."""
        assert self._caching is not None
        req, caching = seq.req, self._caching
        prompt, hit = req.prompt_tokens, None
        if self._prefix is not None:
            hit = self._prefix.fetch(prompt)
            self._sync_prefix_stats()
        cached = hit.tokens if hit is not None else 0
        started = caching.start(prompt[cached:], seq.sampler, seq.processors,
                                cache=hit.cache if hit is not None else None, cache_tokens=prompt[:cached])
        more = req.params.max_tokens - 1
        finish = started.finish_reason or ("length" if more == 0 else None)
        uid = caching.insert([started.token], max(more, 1), seq.sampler, seq.processors, cache=started.cache,
                             cache_tokens=prompt)
        self.stats.started_at_once += 1
        return uid, BatchToken(uid, started.token, finish)

    def _insert(self, seq: _Sequence) -> int:
        req = seq.req
        full = req.prompt_tokens if not seq.history else req.prompt_tokens + seq.history
        remaining = req.params.max_tokens - seq.generated
        caching = self._caching
        if caching is None:
            if seq.admitted:
                self.stats.recomputes += 1
            # Only an image request passes images: a backend that takes none keeps its plain insert.
            extra = {} if req.images is None else {"images": req.images}
            return self.backend.insert(full, remaining, seq.sampler, seq.processors, **extra)
        if req.images is not None:  # a backend that hands out caches (mlx-lm's) takes no images
            raise ValueError("this model does not accept images")
        held = seq.held
        if held is not None:  # resume from its own cache: no recomputation
            self._release(seq)
            n = len(held.tokens)
            if n >= len(full):  # the whole sequence is in it: give back the last token to feed again
                trim_prompt_cache(held.cache, n - len(full) + 1)
                n = len(full) - 1
            self.stats.resumes += 1
            return caching.insert(full[n:], remaining, seq.sampler, seq.processors, cache=held.cache,
                                  cache_tokens=full[:n])
        if seq.admitted:
            self.stats.recomputes += 1
        if self._prefix is None:
            return caching.insert(full, remaining, seq.sampler, seq.processors)
        hit = self._prefix.fetch(full)
        self._sync_prefix_stats()
        cached = hit.tokens if hit is not None else 0
        boundary = req.cache_boundary
        checkpoint = boundary - cached if cached < boundary < len(full) else 0
        if hit is None and not checkpoint:  # the plain call, as any backend takes it
            return caching.insert(full, remaining, seq.sampler, seq.processors)
        return caching.insert(full[cached:], remaining, seq.sampler, seq.processors,
                              cache=hit.cache if hit is not None else None, cache_tokens=full[:cached],
                              checkpoint=checkpoint)

    # --- preemption --------------------------------------------------------------------------------
    def _plan_preemption(self, top: _Sequence) -> tuple[list[_Sequence], bool] | None:
        """The fewest running sequences whose leaving lets ``top`` join, and whether their caches can be
        held then; None if no eligible set does."""
        prio = top.req.priority
        if not self._priorities or min(self._priorities) >= prio:  # the common case: nobody to preempt
            return None
        eligible = [s for s in self._running.values() if s.req.priority < prio and s.key >= top.key]
        if not eligible or not self._fits(top, eligible, hold=False):
            return None
        eligible.sort(key=lambda s: (s.req.priority, -s.key, -s.order))  # lowest priority, latest first
        holds = (True, False) if self._caching is not None else (False,)
        for k in range(1, len(eligible) + 1):  # as few victims as possible; keeping their caches if that fits
            for hold in holds:
                if self._fits(top, eligible[:k], hold=hold):
                    return eligible[:k], hold
        return None

    def _preempt(self, top: _Sequence, victims: list[_Sequence], hold: bool) -> None:
        """Take ``victims`` out of the batch and back into the waiting queue (with their caches if ``hold``)."""
        uids = [v.uid for v in victims]
        for v in victims:
            self._pop_running(v.req.rid)
        taken: dict[int, SequenceCache] = {}
        if self._caching is not None:
            taken = self._caching.take_caches(uids)
        else:
            self.backend.remove(uids)
        self._measured_stale = True
        for v in victims:
            self._park(v, taken.get(v.uid), hold)
            log.info("request %s preempted (priority %d, %d tokens generated; %s) for request %s (priority %d)",
                     v.req.rid, v.req.priority, v.generated, "cache held" if v.held else "to recompute",
                     top.req.rid, top.req.priority)
        self.stats.preemptions += len(victims)
        self._reserve()

    def _park(self, seq: _Sequence, cache: SequenceCache | None, hold: bool) -> None:
        prompt = len(seq.req.prompt_tokens)
        full = prompt + seq.generated
        if seq.history is None:  # first preemption on a caching backend: its tokens come with its cache
            if seq.generated and (cache is None or len(cache.tokens) < full):
                log.error("request %s: preempted without its tokens; failing it", seq.req.rid)
                self._rejected.append(_terminal(seq.req.rid, FinishReason.ERROR, "engine_error",
                                                "the engine lost the request's tokens when preempting it",
                                                seq.generated))
                return
            seq.history = cache.tokens[prompt:full] if cache is not None else []
        resumable = cache is not None and (len(cache.tokens) < full or can_trim_prompt_cache(cache.cache))
        if hold and resumable:
            assert cache is not None
            seq.held, seq.held_bytes = cache, cache.nbytes
            self._held_bytes += seq.held_bytes
        seq.uid = -1
        self._waiting.push(seq.req.rid, seq.key, seq.order, seq)

    def _release(self, seq: _Sequence) -> None:
        """Drop a waiting sequence's held cache (resumed, aborted or failed)."""
        if seq.held is not None:
            self._held_bytes -= seq.held_bytes
            self.stats.kv_bytes = max(0, self.stats.kv_bytes - seq.held_bytes)
            seq.held, seq.held_bytes = None, 0
            self._reserve()

    # --- bookkeeping -------------------------------------------------------------------------------
    def _pop_running(self, rid: str) -> _Sequence | None:
        uid = self._uid_of.pop(rid, None)
        if uid is None:
            return None
        seq = self._running.pop(uid, None)
        if seq is None:
            return None
        left = self._priorities[seq.req.priority] - 1
        if left:
            self._priorities[seq.req.priority] = left
        else:
            del self._priorities[seq.req.priority]
        if self._longest is not None and seq.end >= self._longest:
            self._longest = None
        self._room_dirty = True
        return seq

    def _reserve(self) -> None:
        """Publish the admission estimate (what the admitted sequences may grow to)."""
        if self.memory is not None:
            self.stats.kv_reserved_bytes = (self.memory.batch_bytes(len(self._running), self._max_end())
                                            + self._held_bytes)

    def _update_room(self) -> None:
        self._room_dirty = False
        running = len(self._running)
        free = self.capacity - running
        mem = self.memory
        if mem is None:
            kv_rows = free
        else:
            # Before its first request, a typical one is taken to fill the context: a cold worker claims what
            # it can surely start, and learns the typical size from what it admits.
            typical = int(self._typical_end) or self.context_length or mem.layout.step
            fit = mem.rows_that_fit(max(self._max_end(), typical), self._held_bytes + self._excess())
            # An idle engine takes one whatever the estimate of a typical request says: alone, a request
            # either fits or is refused with a clear error, and a worker that claims nothing serves nobody.
            kv_rows = max(fit - running, 1 if running == 0 else 0)
        outranked = None
        if self._priorities and all(s.admitted for s in self._waiting):
            outranked = min(self._priorities)
        self.room = Room(free, len(self._waiting), kv_rows, outranked)

    def _keep_final_cache(self, tok: GeneratedToken) -> None:
        # mlx-lm's last response of a sequence carries its cache and every token in it. Kept only after a
        # prompt long enough to be worth a lookup itself (the caller checks): copying a cache out is not free.
        cache, tokens = getattr(tok, "prompt_cache", None), getattr(tok, "all_tokens", None)
        if cache is not None and tokens is not None:
            self._finished.append(SequenceCache(list(cache), list(tokens)))

    def _store_caches(self) -> None:
        assert self._prefix is not None and self._caching is not None
        checkpoints = self._caching.take_checkpoints()
        if checkpoints:
            self._prefix.store(checkpoints, "system")
        if self._finished:
            self._prefix.store(self._finished, "assistant")
            self._finished = []
        elif not checkpoints:
            return
        self._sync_prefix_stats()

    def _sync_prefix_stats(self) -> None:
        p, stats = self.prefix_cache, self.stats
        if p is not None:
            stats.prefix_hits, stats.prefix_misses, stats.prefix_tokens_saved = p.hits, p.misses, p.tokens_saved
            stats.prefix_cache_bytes, stats.prefix_cache_entries = p.nbytes, len(p)


def _take_text(seq: _Sequence, out: RequestOutput) -> bool:
    """Add the detokenizer's new text to ``out`` (held back while it may start a stop string); whether a stop
    string appeared (``out.stop_sequence`` names it). Runs per token: without stop strings it is one append."""
    if seq.stops is None:
        out.text += seq.detok.last_segment
        return False
    result = seq.stops.feed(seq.detok.last_segment)
    out.text += result.text
    out.stop_sequence = result.stop
    return result.stopped


def _terminal(rid: str, reason: FinishReason, code: str | None, message: str, generated: int) -> RequestOutput:
    return RequestOutput(
        rid,
        finish=reason,
        completion_tokens=generated,
        error_code=code,
        error_message=message or None,
    )

