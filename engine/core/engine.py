"""One model's engine: the scheduler driven step after step on the model's MLX thread.

Each tick drains the inbox (new requests, aborts; an aborted request ends at once), then runs one scheduler
step and emits its outputs (paced, ``pacer.py``). ``add`` and ``abort`` only enqueue, so asyncio-side
cancellation never reaches into a running MLX call.

Requests claimed together (:meth:`Engine.expect`) reach an idle engine moments apart; its first step waits
while more keep arriving less than a fifth of the admission window apart, up to a full prefill batch or the
window's end, so a burst prefills as one batch; meanwhile a backend that embeds its rows (``engine/mlx/vlm.py``)
embeds each arrival. :meth:`Engine.claim_capacity` tells the worker how many more requests fit soon.

A request whose prompt's prefix is on disk and not in memory (``engine/mlx/prefix/disk.py``) waits outside the scheduler
while a reader thread loads it, and comes back through the inbox once it is in memory (or the wait is over):
the MLX thread never waits on the disk, and the other rows go on decoding meanwhile.

An embedding model's engine is this one driving ``embedding.py``'s scheduler instead: each step one forward pass
over the waiting inputs of every request, no decoding.

It imports no MLX: the backend is ``backend.py``'s protocol, and the thread a :class:`StepThread`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .backend import BatchBackend
from .embedding import EmbeddingBackend, EmbeddingScheduler
from .pacer import Pacer
from .request import EngineRequest, ErrorCode, FinishReason, RequestOutput, terminal
from .scheduler import Scheduler, StepFailed
from .shares import GroupShare, with_queued
from .stats import EngineStats

__all__ = ["Engine", "EngineStats", "StepThread"]

log = logging.getLogger(__name__)

Sink = Callable[[list[RequestOutput]], None]


class StepThread(Protocol):
    """The thread an engine steps on (real: ``engine.mlx.thread.MLXThread``, the model's MLX thread)."""

    @property
    def queued(self) -> int: ...  # calls waiting for the thread
    def submit(self, fn: Callable[..., Any], *args: Any) -> Any: ...
    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Abort:
    rid: str
    reason: FinishReason
    code: ErrorCode | None
    message: str


class Engine:
    """Drives a :class:`Scheduler` on a :class:`StepThread`; outputs go to ``sink`` (called on that thread)."""

    def __init__(
        self,
        thread: StepThread,
        scheduler: Scheduler | EmbeddingScheduler,  # (an embedding model's: engine/core/embedding.py)
        sink: Sink,
        make_backend: Callable[[], BatchBackend] | Callable[[], EmbeddingBackend] | None = None,
        stream_interval_s: float = 0.0,
        prefill_batch: int = 8,
        stream_rate: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.thread = thread
        self.scheduler = scheduler
        self.stats: EngineStats = scheduler.stats  # the scheduler's counters plus the engine's own
        self.on_dead: Callable[[], None] = lambda: None  # called (on the MLX thread) if it cannot recover
        self.on_step: Callable[[float], None] = lambda seconds: None  # each step's duration (on the MLX thread)
        # Called (on the MLX thread) when a step leaves it able to take more requests than before it
        # (claim_capacity or outranking_room grew): a claim that left jobs queued need not wait for a job's end.
        self.on_claimable: Callable[[], None] = lambda: None
        self._claimable = (0, 0)
        self.dead = False
        self._sink = sink
        self._pacer = Pacer(stream_interval_s, rate=stream_rate)
        self._make_backend = make_backend
        self._inbox: deque[EngineRequest | _Abort] = deque()
        self._inbox_requests = 0  # requests added and not yet through a scheduler step (claim_capacity)
        self._inbox_groups: Counter[str] = Counter()  # those requests' groups (groups_open)
        self._drained: list[str] = []  # of those, the groups of the ones this tick took from the inbox
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        self._expected = 0  # requests announced by expect() and not added yet
        self._expected_groups: Counter[str] = Counter()  # the groups expect() named for them
        self._urgent = 0  # of them, interactive ones (expect(interactive=)): beside bulk rows, no step starts
        self._prefill_batch = prefill_batch  # no point waiting for more than one prefill takes
        self._expect_until = 0.0
        self._gap_s = 0.0  # after the announced ones are in, wait while arrivals come closer than this
        self._last_arrival = 0.0
        self._arrived = threading.Event()
        self._clock = clock  # of the admission window (tests drive it by hand)
        scheduler.on_room = self._settle_drained
        self._loading: dict[str, EngineRequest] = {}  # waiting for their prefix to load from disk
        self._loaded: set[str] = set()  # back from loading: they go in as they are
        self._aborted: dict[str, _Abort] = {}  # aborted while on their way back from loading

    def add(self, req: EngineRequest) -> None:
        """Queue a request (thread-safe); a dead engine fails it at once."""
        if self.dead:
            self._sink([terminal(req.rid, FinishReason.ERROR, 0, ErrorCode.ENGINE_ERROR,
                                 "the engine is dead; the worker is restarting")])
            return
        with self._lock:
            self._expected = max(0, self._expected - 1)
            if not req.bulk:
                self._urgent = max(0, self._urgent - 1)
            _drop(self._expected_groups, req.group)
            self._inbox_requests += 1
            self._inbox_groups[req.group] += 1
            self._last_arrival = self._clock()
        self._post(req)
        self._arrived.set()

    def expect(self, n: int, within_s: float, groups: Iterable[str] = (), interactive: int = 0) -> None:
        """Announce ``n`` requests about to be added (thread-safe), of ``groups`` (one each, if known): an idle
        engine waits up to ``within_s`` for them before its first step. ``interactive``: how many of them are not of
        the bulk band: an engine running bulk rows starts no step until they are in, up to ``within_s`` either (they
        start at once, and a step begun meanwhile would hold back their first tokens)."""
        with self._lock:
            if self._clock() >= self._expect_until:  # the earlier announcements' window is over
                self._expected_groups.clear()
                self._urgent = 0
            self._expected += n
            self._urgent += interactive
            self._expected_groups.update(groups)
            self._last_arrival = self._clock()
            self._expect_until = self._last_arrival + within_s
            self._gap_s = within_s / 5

    def abort(
        self, rid: str, reason: FinishReason = FinishReason.CANCELLED, code: ErrorCode | None = None, message: str = ""
    ) -> None:
        """Remove a request between steps (thread-safe); unknown ids are ignored."""
        self._post(_Abort(rid, reason, code, message))

    def claim_capacity(self) -> int:
        """How many more requests this engine can start soon (thread-safe): free sequence slots, bounded by
        the KV headroom left for a typical request, minus the requests already waiting, added or announced
        (:meth:`expect`). As of the last step; 0 once the engine is dead or closed."""
        if self.dead or self._closed:
            return 0
        room = self.scheduler.room  # a frozen record, replaced whole by the engine thread
        return max(0, room.admissible - self._pending())

    def _pending(self) -> int:
        """Requests on their way: added but not yet taken in, or announced (:meth:`expect`)."""
        with self._lock:
            # Announced requests count only within their window: a claimed job that never comes (refused
            # before it reached the engine) must not hold a slot for ever.
            announced = self._expected if self._clock() < self._expect_until else 0
            return self._inbox_requests + announced

    def outranked_priority(self) -> int | None:
        """When this engine has no room (:meth:`claim_capacity` is 0): the priority a new request must exceed
        to start at once anyway, by preempting (the lowest running); None when it has room, runs nothing, or
        requests already on their way take every sequence of that priority (thread-safe; as of the last step)."""
        return self.scheduler.room.outranked if self.outranking_room() else None

    def outranking_room(self) -> int:
        """How many more requests above :meth:`outranked_priority` would start at once now: one per running
        sequence of the lowest priority (each preempts one), less the requests already on their way."""
        if self.dead or self._closed:
            return 0
        room = self.scheduler.room
        if room.outranked is None or room.admissible > 0:
            return 0
        return max(0, room.outranked_rows - self._pending())

    def groups_open(self) -> tuple[GroupShare, ...]:
        """When this engine has no room (counting the requests on their way): each running group's part of the
        batch, which a new request of a group below its share takes from at once (``shares.py``), with its
        requests waiting unstarted, added and not taken in yet, or announced counted as queued (so a claim does
        not take a second one on the same ground before the first is in); () when it has room or runs nothing
        (thread-safe; as of the last step). A request on its way does not close the parts: a flood's next job
        is on its way at most moments, and a job of a tenant below its share must not wait for a step to end."""
        if self.dead or self._closed:
            return ()
        room = self.scheduler.room
        if not room.groups or room.admissible > self._pending():
            return ()
        with self._lock:
            on_way = self._inbox_groups.copy()
            if self._clock() < self._expect_until:
                on_way.update(self._expected_groups)
        return with_queued(room.groups, on_way)

    def paused(self) -> int:
        """Its preempted requests, waiting to resume (thread-safe; as of the last step)."""
        return self.scheduler.room.paused

    def counters(self) -> EngineStats:
        """Its counters, the disk tier's as of now (thread-safe): the tier's threads count on their own, and a step
        copies their counts in, so an idle engine's would stay as they were at its last step."""
        prefix = self.scheduler.prefix_cache
        disk = prefix.disk_counts() if prefix is not None else None
        if disk is not None:
            self.stats.take_disk(disk)
        return self.stats

    @property
    def prefix_min_tokens(self) -> int | None:
        """The shortest prompt its prefix cache stores (None: no prefix cache)."""
        prefix = self.scheduler.prefix_cache
        return prefix.min_tokens if prefix is not None else None

    def prefix_tagged(self) -> list[tuple[str, list[int]]]:
        """The affinity keys (``EngineRequest.affinity``) its prefix cache's entries on disk carry, each with its
        entry's tokens, least recently used first (thread-safe): what a restarted worker holds already."""
        prefix = self.scheduler.prefix_cache
        return prefix.tagged() if prefix is not None else []

    async def prefix_holds(self, prompts: list[list[int]]) -> list[bool]:
        """Whether its prefix cache (memory or disk) still holds each of ``prompts``; asked on its MLX thread."""
        prefix = self.scheduler.prefix_cache
        if prefix is None or self.dead or self._closed:
            return [False] * len(prompts)
        held: list[bool] = await asyncio.wrap_future(self.thread.submit(prefix.holds, prompts))
        return held

    async def aclose(self) -> None:
        """Stop ticking, hand the warm prefixes to the disk tier, and join the MLX thread; returns only once no
        MLX call is running and the disk's writes are finished (bounded)."""
        with self._lock:
            self._closed = True
        prefix = self.scheduler.prefix_cache
        if prefix is not None and not self.dead:
            try:
                await asyncio.wrap_future(self.thread.submit(prefix.persist))
            except Exception:
                log.warning("could not keep the prefix cache on disk at the stop", exc_info=True)
        await self.thread.aclose()
        if prefix is not None:
            await asyncio.to_thread(prefix.close)

    def _post(self, cmd: EngineRequest | _Abort) -> None:
        self._inbox.append(cmd)
        with self._lock:
            if self._scheduled or self._closed:
                return
            self._scheduled = True
        self.thread.submit(self._tick)

    # --- on the MLX thread -------------------------------------------------------------------------
    def _tick(self) -> None:
        # Steps run back to back while nothing else waits for the MLX thread: a hop through its executor
        # per step is time the thread does not step.
        while True:
            try:
                if not self.scheduler.num_running:
                    self._await_expected()
                elif self._urgent:
                    self._await_interactive()
                try:
                    self._emit(self._drain_inbox())
                    if self.scheduler.has_work:
                        t0 = time.perf_counter()
                        outs = self.scheduler.step(self._pacer.deferred)  # tokens join what the pacer defers
                        self.stats.steps += 1
                        self.on_step(time.perf_counter() - t0)
                        self._emit(outs)
                        self._note_claimable()
                finally:  # (a failed step, or no step: the scheduler did not settle them)
                    self._settle_drained()
            except Exception as exc:  # an engine step failed: fail what was in flight, keep serving
                self._on_failure(exc)
            with self._lock:
                again = not self._closed and (self.scheduler.has_work or bool(self._inbox))
                self._scheduled = again
            if not again:
                return
            if self.thread.queued:
                self.thread.submit(self._tick)
                return

    def _note_claimable(self) -> None:
        room, outranking = self.claim_capacity(), self.outranking_room()
        if room > self._claimable[0] or outranking > self._claimable[1]:
            self.on_claimable()
        self._claimable = (room, outranking)

    def _settle_drained(self) -> None:
        """The requests drained from the inbox count in the scheduler's room now (or have ended): no longer on
        their way. Called by the scheduler mid-step (``Scheduler.on_room``), before its batch step."""
        if self._drained:
            with self._lock:
                self._inbox_requests -= len(self._drained)
                for group in self._drained:
                    _drop(self._inbox_groups, group)
            self._drained = []

    def _await_expected(self) -> None:
        ahead = getattr(self.scheduler.backend, "embed_ahead", None)  # only a backend that embeds its rows
        looked = 0  # inbox entries handed to it so far (only this thread pops the inbox)
        while True:
            with self._lock:
                now = self._clock()
                left = self._expect_until - now
                full = len(self._inbox) >= self._prefill_batch  # the inbox holds requests (and maybe aborts)
                if left <= 0 or self._closed or full:
                    if not full:
                        self._expected = 0
                    return
                # Announced ones still coming: wait for them. All in, and more than one: a burst is being
                # enqueued, so linger while it keeps arriving. A lone request never lingers.
                if self._expected > 0:
                    wait = left
                else:
                    burst = len(self._inbox) > 1
                    wait = min(left, self._last_arrival + self._gap_s - now) if burst else 0.0
                if wait <= 0:
                    return
                self._arrived.clear()  # under the lock: add() decrements under it before setting
                arrived = len(self._inbox)
            if ahead is not None and looked < arrived:  # the first step's work on the new arrivals, now; look again
                for i in range(looked, min(arrived, self._prefill_batch)):  # what the first step can take
                    cmd = self._inbox[i]  # others only append: the entries before ``arrived`` stay put
                    if isinstance(cmd, EngineRequest):
                        ahead(cmd.prompt_tokens, cmd.images)
                looked = arrived
                continue
            self._held_for_arrivals(wait)

    def _await_interactive(self) -> None:
        """Interactive requests are on their way (claimed, being prepared): beside bulk rows they start at once,
        so the next step waits for them (up to the window): begun now, it would hold back their first tokens, and
        the time preparing them takes on the event loop is time the MLX threads hold the CPU."""
        while True:
            with self._lock:
                left = self._expect_until - self._clock()
                if left <= 0 or self._closed or not self.scheduler.num_running_bulk:
                    self._urgent = 0  # (past the window: one never came; no bulk row: they start as others do)
                if not self._urgent:
                    return
                self._arrived.clear()  # under the lock: add() decrements under it before setting
            self._held_for_arrivals(left)

    def _held_for_arrivals(self, wait: float) -> None:
        """Wait up to ``wait`` for an arrival, counting the time the next step was held."""
        t0 = time.perf_counter()
        self._arrived.wait(wait)
        self.stats.admission_wait_ms += round((time.perf_counter() - t0) * 1000)

    def _drain_inbox(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, EngineRequest):
                gone = self._aborted.pop(cmd.rid, None) if self._aborted else None
                if gone is not None:
                    self._drained.append(cmd.group)
                    outs.append(terminal(cmd.rid, gone.reason, 0, gone.code, gone.message))
                    continue
                if self._load_prefix(cmd):
                    continue
                self._drained.append(cmd.group)
                if cmd.bulk:  # its outputs go out with its end (pacer.py)
                    self._pacer.hold(cmd.rid)
                self.scheduler.add(cmd)
            else:
                out = self.scheduler.abort(cmd.rid, cmd.reason, cmd.code, cmd.message)
                if out is None:
                    out = self._abort_loading(cmd)
                if out is not None:
                    outs.append(out)
        return outs

    def _load_prefix(self, req: EngineRequest) -> bool:
        """Whether ``req`` waits for its prompt's prefix to load from disk (it comes back through the inbox)."""
        prefix = self.scheduler.prefix_cache
        with self._lock:
            if prefix is None or req.rid in self._loaded:
                self._loaded.discard(req.rid)
                return False
            self._loading[req.rid] = req  # before the load starts: its end may come at once

        def done() -> None:  # on the reader's thread or a timer's
            with self._lock:
                back = self._loading.pop(req.rid, None)
                if back is None:  # aborted meanwhile
                    return
                self._loaded.add(req.rid)
            self._post(back)

        if prefix.prefetch(req.prompt_tokens, done):
            return True
        with self._lock:
            self._loading.pop(req.rid, None)
        return False

    def _abort_loading(self, cmd: _Abort) -> RequestOutput | None:
        with self._lock:
            req = self._loading.pop(cmd.rid, None)
            if req is None:
                if cmd.rid in self._loaded:  # back in the inbox, behind this abort: it ends when drained
                    self._loaded.discard(cmd.rid)
                    self._aborted[cmd.rid] = cmd
                return None
            self._inbox_requests -= 1  # it never reaches the scheduler
            _drop(self._inbox_groups, req.group)
        return terminal(cmd.rid, cmd.reason, 0, cmd.code, cmd.message)

    def _emit(self, outs: list[RequestOutput]) -> None:
        # Nothing is deferred once the engine goes idle: no later tick would send it.
        due = self._pacer.push(outs, flush=not self.scheduler.has_work)
        if due:
            self._sink(due)

    def _on_failure(self, exc: Exception) -> None:
        self.stats.failures += 1
        log.exception("engine step failed; failing %d requests", len(self.scheduler.request_ids()))
        if isinstance(exc, StepFailed):
            self._emit(exc.outputs)
            exc = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        self._emit(self.scheduler.fail_all(ErrorCode.ENGINE_ERROR, f"engine step failed: {exc!r}"))
        if self._make_backend is None:
            return
        try:  # closed before its replacement is made, not left to the GC: one open generator at a time
            self.scheduler.backend.close()
        except Exception:
            log.warning("could not close the failed batch", exc_info=True)
        try:
            self.scheduler.backend = self._make_backend()
        except Exception:
            log.exception("could not rebuild the batch; the engine is dead")
            self.dead = True
            with self._lock:
                self._closed = True
            self.on_dead()


def _drop(counter: Counter[str], key: str) -> None:
    """One less of ``key`` (none left: gone from the counter, so an empty counter is falsy)."""
    left = counter[key] - 1
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)
