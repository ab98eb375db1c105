"""The continuous-batching scheduler: admit waiting requests, step the batch, report each request's output.

It knows nothing of Redis, asyncio or threads (tests drive it with a fake backend); the engine calls it on the
model's MLX thread. Each :meth:`Scheduler.step` expires deadlines, admits waiting requests (in priority order
with aging, ``waiting.py``; the first that does not fit, by :class:`~engine.core.admission.KVAdmission`, holds back
the rest), runs one batch step and hands each row's tokens to its :class:`~engine.core.sequence.Sequence`.

Preemption (as vLLM's, counting slots as well as memory): running sequences of strictly lower priority whose
aged key is no better leave for a waiting one, lowest and latest first, as few as make room (the plan:
``preemption.py``). Groups (a worker's tenants) share the batch by weight (``shares.py``): priority preempts
within a group; a waiting request of a group below its share, even behind the head, takes a place of one above.
How a sequence enters the batch and what becomes of its cache is the backend's
:class:`~engine.core.cache_strategy.CacheStrategy` (``backend.py``'s protocols: no MLX here); a step's tokens
go into its outputs by ``step_outputs.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from .admission import KVAdmission
from .backend import BatchBackend, GeneratedToken, PrefixStore, SequenceCache
from .bulk import BulkAdmission
from .cache_strategy import CacheStrategy, strategy_for
from .deadlines import Deadlines
from .memory import KVBudget
from .preemption import Preemption, drop_parked_caches, plan_preemption
from .request import EngineRequest, ErrorCode, FinishReason, RequestOutput, SamplingParams, terminal
from .room import Room
from .running import Running
from .sequence import Detokenizer, Sequence
from .shares import Shares
from .starts import starts_at_once, together
from .stats import EngineStats
from .step_outputs import StepFailed, StepOutputs
from .waiting import WaitingQueue, priority_key

__all__ = ["Detokenizer", "Room", "Scheduler", "StepFailed"]

log = logging.getLogger(__name__)


_NONE_DEFERRED: Mapping[str, RequestOutput] = MappingProxyType({})


class Scheduler:
    """Runs requests through a :class:`BatchBackend` of at most ``capacity`` sequences.

    ``memory``: admit by KV bytes (None: by slots only). ``prefix_cache``: reuse cached prompt prefixes (only
    with a backend that supports caches). ``aging_s``: seconds of waiting worth one priority level.
    ``context_length``: requests longer than this are refused. ``bulk_hold_s``: how long after its last interactive
    row a step still admits bulk requests one at a time (``bulk.py``).
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
        prefix_cache: PrefixStore | None = None,
        aging_s: float = 1.0,
        context_length: int | None = None,
        stats: EngineStats | None = None,
        bulk_hold_s: float = 0.0,
    ) -> None:
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.aging_s = aging_s
        self.context_length = context_length
        self.stats = stats if stats is not None else EngineStats()
        self.kv = KVAdmission(capacity, memory, self.stats, context_length)
        self._new_detokenizer = new_detokenizer
        self._make_sampler = make_sampler
        self._make_processors = make_processors
        self._clock = clock
        self._waiting: WaitingQueue[Sequence] = WaitingQueue()
        self._shares = Shares()  # running sequences per group, and the waiting ones' groups
        self._running = Running(self._shares)
        self._rejected: list[RequestOutput] = []  # refused by add(): reported by the next step
        self._deadlines = Deadlines()
        self._orders = itertools.count()
        self._postponed: Preemption | None = None  # its victims leave at the next step's start (_admit)
        self._bulk = BulkAdmission(bulk_hold_s)  # bulk requests a step admits beside interactive ones (bulk.py)
        self._typical_end = 0.0  # running mean of admitted requests' ``end`` (for Room)
        self._room_dirty = True
        self.backend = backend
        self.room = Room(capacity, 0, capacity)
        # Called each step once the room counts what the step admitted, before the batch step: the engine's
        # requests added before the step stop counting as on their way there (Engine._settle_drained).
        self.on_room: Callable[[], None] = lambda: None
        self._update_room()  # what the KV headroom allows, before the first step

    # --- state -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Sequences decoding at once."""
        return self.kv.capacity

    @property
    def backend(self) -> BatchBackend:
        return self._cache.backend

    @backend.setter
    def backend(self, backend: BatchBackend) -> None:
        """Use ``backend`` (a new one after a failure): what it can do decides the cache strategy."""
        self._cache: CacheStrategy = strategy_for(backend, self.prefix_cache, self.stats)
        self.kv.use(getattr(backend, "kv_bytes", None))

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._rejected)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_running_bulk(self) -> int:
        """Running sequences of the bulk band (``EngineRequest.bulk``)."""
        return self._running.bulk

    def request_ids(self) -> list[str]:
        return [r.rid for r in self.requests()]

    def requests(self) -> list[EngineRequest]:
        return [s.req for s in self._waiting] + [s.req for s in self._running]

    # --- commands ----------------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Queue a request; it joins the batch at a step with room for it (or is refused at the next step)."""
        problem = self.kv.never_fits(len(req.prompt_tokens), req.params.max_tokens)
        if problem is not None:
            self.stats.rejected_too_large += 1
            log.info("request %s refused: %s", req.rid, problem)
            self._rejected.append(terminal(req.rid, FinishReason.ERROR, 0, ErrorCode.BAD_REQUEST, problem))
            return
        arrival = req.arrival or self._clock()
        seq = Sequence.of(req, self._new_detokenizer(), priority_key(arrival, req.priority, self.aging_s, req.bulk),
                          next(self._orders))
        self._push(seq)
        self._room_dirty = True
        self._deadlines.add(req.deadline)

    def abort(self, rid: str, reason: FinishReason = FinishReason.CANCELLED, code: ErrorCode | None = None,
              message: str = "") -> RequestOutput | None:
        """Remove a request wherever it is (its memory freed); its terminal output, or None for an unknown id."""
        seq = self._pop_running(rid)
        if seq is not None:
            self.backend.remove([seq.uid])
            self.kv.read()
        else:
            seq = self._take(rid)
            if seq is None:
                return None
            self.kv.unpark(seq)
        self._update_room()
        return terminal(rid, reason, seq.generated, code, message)

    def fail_all(self, code: ErrorCode, message: str) -> list[RequestOutput]:
        """Fail every request (the batch is unusable); the caller replaces the backend."""
        seqs = [*self._running, *self._waiting]
        outs = [terminal(s.rid, FinishReason.ERROR, s.generated, code, message) for s in seqs] + self._rejected
        self._running.clear()
        self._waiting.clear()
        self._postponed = None
        self._rejected = []
        self._cache.clear()  # memory may be what failed
        self.kv.clear()
        self._update_room()
        return outs

    # --- the step ----------------------------------------------------------------------------------
    def step(self, deferred: Mapping[str, RequestOutput] = _NONE_DEFERRED) -> list[RequestOutput]:
        """Expire deadlines, admit waiting requests, run one batch step, report per request. ``deferred``: outputs
        not sent yet (the pacer's), which this step's tokens of their requests are added to in place (each then
        reported as the step's own output of its request)."""
        outs = StepOutputs(deferred)
        if self._rejected:
            for out in self._rejected:
                outs.by_rid[out.rid] = out
            self._rejected = []
        self._expire(outs)
        if self._postponed is not None:
            self._preempt_postponed(self._postponed)
        started_at_once = self._admit(outs)
        if self._room_dirty:  # a claim during the batch step sees what this one admitted (a long first prefill)
            self._update_room()
        self.on_room()
        if self._running:
            # A request started at once (see _admit) has its first token: it goes out now, not after a decode.
            if not started_at_once:
                try:
                    tokens = self.backend.step()
                except Exception as exc:
                    raise StepFailed(list(outs.by_rid.values())) from exc
                self._on_tokens(tokens, outs)
            if outs.logprobs:
                self.backend.attach_logprobs(outs.logprobs)
            self._cache.after_step()
            self.kv.read()
        if self._room_dirty:
            self._update_room()
        return list(outs.by_rid.values())

    def _expire(self, outs: StepOutputs) -> None:
        for rid in self._deadlines.passed(self._clock(), self.requests):
            out = self.abort(rid, FinishReason.ERROR, ErrorCode.TIMEOUT, "the job ran past its deadline")
            if out is not None:
                outs.by_rid[rid] = out

    def _on_tokens(self, tokens: Iterable[GeneratedToken], outs: StepOutputs) -> None:
        """A step's tokens, one per row: a row that goes on with neither log-probabilities nor a format (the
        common case, N per step) takes the short way; any other goes through :meth:`_on_token`."""
        running, by_rid, deferred = self._running, outs.by_rid, outs.deferred
        for tok in tokens:
            seq = running.get(tok.uid)
            if seq is None:  # removed since the step began
                continue
            if not seq.plain or tok.finish_reason is not None:
                self._on_token(tok, outs)
                continue
            rid = seq.req.rid
            out = by_rid.get(rid)
            if out is None:
                out = deferred.get(rid)
                if out is None:
                    out = RequestOutput(rid)
                by_rid[rid] = out
            if seq.accept(tok.token, None, out) is not None:
                self._cache.retire(seq)
                self._pop_running(rid)

    def _on_token(self, tok: GeneratedToken, outs: StepOutputs) -> None:
        seq = self._running.get(tok.uid)
        if seq is None:  # removed since the step began
            return
        end = tok.finish_reason  # the backend ended the row: it has left the batch
        if end is not None:
            self._cache.ended(seq, tok)
        if outs.accept(seq, tok) is not None:
            if end is None:
                self._cache.retire(seq)
            self._pop_running(seq.rid)

    # --- admission ---------------------------------------------------------------------------------
    def _admit(self, outs: StepOutputs) -> int:
        """Admit waiting requests in order, up to those starting at once (prefilled together, ``starts.py``; their
        first tokens are out), bulk ones as many as ``bulk.py`` lets a step take; how many started at once."""
        self._bulk.start(len(self._running) > self._running.bulk, self._clock())
        if self._cache.starts_at_once:  # those starting at once in this step, prefilled together
            free = self.capacity - len(self._running) + self._running.bulk  # (a bulk row yields its slot at once)
            self._cache.prestart([self._equip(s) for s in together(self._waiting, self._running, self._shares, free)])
        at_once = 0
        while self._waiting:
            seq = self._waiting.peek()
            assert seq is not None
            if not self._bulk.admits(seq):
                break
            plan = None
            if not self.kv.fits(seq):
                plan = self._plan(seq)
                if plan is None:
                    other = self._shares.furthest_below(seq.req, self._waiting)
                    plan = self._plan(other) if other is not None else None
                    if plan is not None and other is not None:
                        seq = other
                    elif not drop_parked_caches(seq, self._waiting, self.kv, self.kv.unpark):
                        break
            urgent = self._cache.starts_at_once and starts_at_once(seq, plan, self._running, self._shares)
            alone = self._cache.prestarted <= 1  # no other request starts at once beside it in this step
            if plan is not None and not (urgent and alone and self.kv.fits(seq, slots=False)):
                self._preempt(plan)
                plan = None
            self._take(seq.rid)  # not pop(): a preempted sequence may share its key
            self._bulk.admitted(seq)
            at_once += self._launch(seq, outs, urgent)
            if plan is not None and self._running.has(seq.rid):
                # Only a slot was short: the victims leave at the start of the next step, so its first token,
                # out with this step's outputs, does not wait for their caches to be copied out of the batch.
                self._postponed = plan
                break
            if at_once and not self._cache.prestarted:  # the next one's prefill would hold back their first tokens
                break
        self._cache.prestart([])  # (any left did not start at once after all)
        return at_once

    def _plan(self, seq: Sequence) -> Preemption | None:
        return plan_preemption(seq, self._running, self._running.lowest_priority, self.kv,
                               self._cache.parks_caches, self._shares)

    def _launch(self, seq: Sequence, outs: StepOutputs, at_once: bool = False) -> int:
        """Insert ``seq`` into the batch: a new request, or a preempted one resuming. ``at_once``: prefill it first
        (alone, or with those starting together). Returns 1 if it started at once, else 0."""
        req = seq.req
        resumed = seq.admitted
        if not resumed:
            self._equip(seq)
        first = None
        try:
            if at_once:
                uid, first = self._cache.start(seq)
            else:
                uid = self._cache.insert(seq, self.kv.unpark(seq))
        except ValueError as exc:
            self.kv.unpark(seq)
            outs.by_rid[req.rid] = terminal(req.rid, FinishReason.ERROR, seq.generated, ErrorCode.BAD_REQUEST,
                                            str(exc))
            return 0
        except Exception as exc:
            self._push(seq)  # still owned here, so fail_all() reaches it
            raise StepFailed(list(outs.by_rid.values())) from exc
        seq.uid, seq.admitted = uid, True
        self._running.add(seq)
        self.kv.join(seq)
        self._room_dirty = True
        self.kv.reserve()
        if not resumed:
            out = outs.get(req.rid)
            out.started, out.prompt_tokens, out.cached_tokens = True, len(req.prompt_tokens), seq.cached
            self._typical_end += (seq.end - self._typical_end) / (8 if self._typical_end else 1)
        if first is None:
            return 0
        if first.finish_reason is not None:  # it ended with its first token: it leaves the batch unstarted
            self.backend.remove([uid])
        self._on_token(first, outs)
        return 1

    def _equip(self, seq: Sequence) -> Sequence:
        if not seq.equipped:  # (a sequence started together with others was equipped for that: starts.py)
            seq.equip(self._make_sampler(seq.req.params), self._make_processors(seq.req.params))
            self._cache.prepare(seq)
        return seq

    # --- preemption --------------------------------------------------------------------------------
    def _preempt(self, plan: Preemption) -> None:
        """Take the victims out of the batch and back into the waiting queue (with their caches if parked)."""
        for v in plan.victims:
            self._pop_running(v.rid)
        taken = self._cache.take(plan.victims)
        for v in plan.victims:
            self._park(v, taken.get(v.uid), plan.park)
            log.info("%s", plan.describe(v))
        self.stats.preemptions += len(plan.victims)
        self.kv.reserve()

    def _preempt_postponed(self, plan: Preemption) -> None:
        self._postponed = None
        if self._running.get(plan.top.uid) is not plan.top:  # aborted since it started: its slot is back
            return
        plan.victims = [v for v in plan.victims if self._running.get(v.uid) is v]  # any may be aborted since
        if plan.victims:
            self._preempt(plan)

    def _park(self, seq: Sequence, cache: SequenceCache | None, park: bool) -> None:
        problem = self._cache.park(seq, cache, park)
        if problem is not None:
            log.error("request %s: %s; failing it", seq.rid, problem)
            self._rejected.append(terminal(seq.rid, FinishReason.ERROR, seq.generated, ErrorCode.ENGINE_ERROR,
                                           problem))
            return
        self.kv.park(seq.parked_bytes)
        seq.uid = -1
        self._push(seq)

    # --- bookkeeping -------------------------------------------------------------------------------
    def _push(self, seq: Sequence) -> None:
        self._waiting.push(seq.rid, seq.key, seq.order, seq)
        self._shares.wait(seq.req)

    def _take(self, rid: str) -> Sequence | None:
        """Take a waiting sequence out of the queue; None if ``rid`` is not waiting."""
        seq = self._waiting.remove(rid)
        if seq is not None:
            self._shares.unwait(seq.req)
        return seq

    def _pop_running(self, rid: str) -> Sequence | None:
        seq = self._running.pop(rid)
        if seq is not None:
            self.kv.leave(seq)
            self._room_dirty = True
        return seq

    def _update_room(self) -> None:
        self._room_dirty = False
        # Before its first request, a typical one is taken to fill the context: a cold worker claims what it
        # can surely start, and learns the typical size from what it admits.
        typical = int(self._typical_end) or self.context_length or (self.memory.layout.step if self.memory else 1)
        self.room = Room.of(self.capacity - len(self._running), self._waiting, self.kv.kv_rows(typical),
                            self._running.priorities, self._shares)
