"""Embedding requests scheduled in the same continuous scheme as generation: the :class:`EmbeddingScheduler`.

An embedding request is a job's inputs (token lists); each input is a row. Rows wait in arrival order (higher
priority first); each step takes the oldest rows, from as many requests as fit (at most ``max_rows`` rows and
``max_tokens`` padded tokens), and runs them through the model in one forward pass (the backend's
:meth:`EmbeddingBackend.embed`: no decoding, no KV cache kept). A request ends, with every vector, once its last
row has been through. Rows arriving while a pass runs wait in the engine's inbox and join the next step: so a
burst of small jobs from many clients goes through in a few large passes.

The scheduler is driven by :class:`~.engine.Engine` (its inbox, aborts, admission window and failure handling are
the generation engine's own) and imports no MLX: the backend is ``engine/mlx/embedding.py``'s, and the tests drive
it with fakes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .request import EngineRequest, ErrorCode, FinishReason, RequestOutput, terminal
from .room import Room
from .stats import EngineStats

__all__ = ["EmbeddingBackend", "EmbeddingRequest", "EmbeddingScheduler", "Row"]


@dataclass(slots=True)
class EmbeddingRequest(EngineRequest):
    """One embedding job: ``inputs`` (each a token list, embedded as it is) and the length its vectors are cut to
    (``dimensions``; None: the model's width). ``prompt_tokens`` is unused (empty)."""

    inputs: list[list[int]] = field(default_factory=list)
    dimensions: int | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """One input of a request, as a forward pass takes it."""

    rid: str
    index: int  # its place among its request's inputs
    tokens: list[int]
    dimensions: int | None


class EmbeddingBackend(Protocol):
    """The model's forward pass (real: ``engine.mlx.embedding.EmbeddingBatch``; tests: a fake)."""

    def embed(self, rows: Sequence[Row]) -> list[bytes]:
        """Each row's vector, in order: its last token's final hidden state, L2-normalised, cut to its
        ``dimensions`` and normalised again, as little-endian float32 bytes; all rows in one forward pass."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Pending:
    req: EmbeddingRequest
    vectors: list[bytes | None]
    left: int  # rows not through yet
    tokens: int  # its inputs' tokens (its usage)


@dataclass(slots=True)
class _Counts:
    """What the passes did, since the engine started (read by benchmarks and tests)."""

    passes: int = 0  # forward passes run
    rows: int = 0  # inputs embedded
    largest: int = 0  # most rows in one pass
    mixed: int = 0  # passes that took rows of more than one request


class EmbeddingScheduler:
    """Takes embedding requests, and each step runs the oldest waiting rows through the backend at once.

    It has the surface :class:`~.engine.Engine` drives a scheduler by (``add``, ``abort``, ``step``, ``room``, ...):
    its room counts requests (``capacity`` of them waiting at most), not KV memory, and nothing runs between
    steps, so nothing is ever preempted and there is no prefix cache.
    """

    prefix_cache = None  # (the engine asks; embeddings keep no KV)

    def __init__(self, backend: EmbeddingBackend, *, capacity: int = 32, max_rows: int = 32,
                 max_tokens: int = 16384, stats: EngineStats | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.capacity = capacity  # requests taken in at once (the worker's room)
        self.max_rows = max_rows  # rows in one forward pass
        self.max_tokens = max_tokens  # padded tokens in one forward pass (rows x the longest), beyond one row
        self.stats = stats if stats is not None else EngineStats()
        self.counts = _Counts()
        self.on_room: Callable[[], None] = lambda: None  # the engine's: its drained requests count here now
        self.room = Room(capacity, 0, capacity)
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._rows: deque[Row] = deque()  # waiting, in the order they run
        self._refused: list[RequestOutput] = []  # ended when added: sent with the next step's outputs

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._refused)

    @property
    def num_running(self) -> int:
        """Requests with rows still to run (the health record's running jobs)."""
        return len(self._pending)

    @property
    def num_running_bulk(self) -> int:
        """Of those, the bulk band's (an embedding job of a batch: below every interactive priority)."""
        return sum(1 for p in self._pending.values() if p.req.bulk)

    def request_ids(self) -> list[str]:
        return list(self._pending)

    def add(self, req: EngineRequest) -> None:
        """Queue a request's rows (a generation request here is a worker's bug: it ends with bad_request)."""
        if not isinstance(req, EmbeddingRequest) or not req.inputs:
            self._refused.append(terminal(req.rid, FinishReason.ERROR, 0, ErrorCode.BAD_REQUEST,
                                          "this engine serves an embedding model: it takes embedding inputs only"))
            return
        self._pending[req.rid] = _Pending(req, [None] * len(req.inputs), len(req.inputs),
                                          sum(len(t) for t in req.inputs))
        rows = [Row(req.rid, i, tokens, req.dimensions) for i, tokens in enumerate(req.inputs)]
        # Rows stay in descending priority (arrival order within one): the last waiting row's is the lowest.
        if self._rows and self._pending[self._rows[-1].rid].req.priority < req.priority:
            self._rows = deque(sorted([*self._rows, *rows], key=lambda r: -self._pending[r.rid].req.priority))
        else:
            self._rows.extend(rows)
        self._update_room()

    def abort(self, rid: str, reason: FinishReason = FinishReason.CANCELLED, code: ErrorCode | None = None,
              message: str = "") -> RequestOutput | None:
        """End a request between steps; None for an unknown id."""
        if self._pending.pop(rid, None) is None:
            return None
        self._rows = deque(r for r in self._rows if r.rid != rid)
        self._update_room()
        return terminal(rid, reason, 0, code, message)

    def fail_all(self, code: ErrorCode, message: str) -> list[RequestOutput]:
        """End every request with an error (the backend failed)."""
        outs = [terminal(rid, FinishReason.ERROR, 0, code, message) for rid in self._pending]
        self._pending.clear()
        self._rows.clear()
        self._update_room()
        return outs

    def step(self, deferred: Mapping[str, RequestOutput] | None = None) -> list[RequestOutput]:
        """Expire requests past their deadline, then run the next rows in one forward pass; the outputs of the
        requests that ended (``deferred``: the engine's pacer's, unused: nothing here streams)."""
        outs, self._refused = self._refused, []
        outs.extend(self._expire())
        self.on_room()
        batch = self._next_rows()
        if not batch:
            self._update_room()
            return outs
        vectors = self.backend.embed(batch)
        self._count(batch)
        for row, vector in zip(batch, vectors, strict=True):
            pending = self._pending[row.rid]
            pending.vectors[row.index] = vector
            pending.left -= 1
            if pending.left == 0:
                del self._pending[row.rid]
                outs.append(_finished(pending))
        self._update_room()
        return outs

    def _next_rows(self) -> list[Row]:
        """The oldest waiting rows that fit one pass: at most ``max_rows``, and rows x the longest at most
        ``max_tokens`` (the first row always goes, however long)."""
        taken: list[Row] = []
        longest = 0
        while self._rows and len(taken) < self.max_rows:
            longer = max(longest, len(self._rows[0].tokens))
            if taken and longer * (len(taken) + 1) > self.max_tokens:
                break
            taken.append(self._rows.popleft())
            longest = longer
        return taken

    def _expire(self) -> list[RequestOutput]:
        now = self._clock()
        late = [rid for rid, p in self._pending.items() if p.req.deadline is not None and now >= p.req.deadline]
        return [out for rid in late if (out := self.abort(rid, FinishReason.ERROR, ErrorCode.TIMEOUT,
                                                          "the job ran past its deadline")) is not None]

    def _count(self, batch: Iterable[Row]) -> None:
        rows = list(batch)
        c = self.counts
        c.passes += 1
        c.rows += len(rows)
        c.largest = max(c.largest, len(rows))
        c.mixed += len({r.rid for r in rows}) > 1

    def _update_room(self) -> None:
        free = max(0, self.capacity - len(self._pending))
        self.room = Room(free, 0, free)


def _finished(pending: _Pending) -> RequestOutput:
    vectors = [v for v in pending.vectors if v is not None]
    return RequestOutput(pending.req.rid, started=True, prompt_tokens=pending.tokens, finish=FinishReason.STOP,
                         embeddings=vectors)
