"""The continuous-batching scheduler: admit waiting requests, step the batch, turn tokens into outputs.

It knows nothing of Redis, asyncio or threads, so tests drive it step by step with a fake backend.
The engine calls it only from the model's MLX thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .batch import BatchBackend, GeneratedToken
from .request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from .stops import StopMatcher

__all__ = ["Detokenizer", "Scheduler", "StepFailed"]

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


@dataclass(slots=True)
class _Sequence:
    req: EngineRequest
    uid: int
    detok: Detokenizer
    stops: StopMatcher | None  # None without stop strings
    generated: int = 0


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
    """Runs requests through a :class:`BatchBackend` of at most ``capacity`` sequences."""

    def __init__(
        self,
        backend: BatchBackend,
        *,
        capacity: int,
        new_detokenizer: Callable[[], Detokenizer],
        make_sampler: Callable[[SamplingParams], Any] = lambda p: None,
        make_processors: Callable[[SamplingParams], list[Any]] = lambda p: [],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.capacity = capacity
        self._new_detokenizer = new_detokenizer
        self._make_sampler = make_sampler
        self._make_processors = make_processors
        self._clock = clock
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[int, _Sequence] = {}
        self._uid_of: dict[str, int] = {}
        self._next_deadline = math.inf  # no request's deadline is earlier (it may be a gone request's)

    # --- state -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def request_ids(self) -> list[str]:
        return [r.rid for r in self._waiting] + [s.req.rid for s in self._running.values()]

    # --- commands ----------------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Queue a request; it joins the batch at the next step with a free slot."""
        self._waiting.append(req)
        if req.deadline is not None:
            self._next_deadline = min(self._next_deadline, req.deadline)

    def abort(
        self, rid: str, reason: FinishReason = FinishReason.CANCELLED, code: str | None = None, message: str = ""
    ) -> RequestOutput | None:
        """Remove a request wherever it is; its terminal output, or None for an unknown id."""
        seq = self._pop_running(rid)
        if seq is not None:
            self.backend.remove([seq.uid])
            return _terminal(rid, reason, code, message, seq.generated)
        for req in self._waiting:
            if req.rid == rid:
                self._waiting.remove(req)
                return _terminal(rid, reason, code, message, 0)
        return None

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Fail every request (the batch is unusable); the caller replaces the backend."""
        outs = [_terminal(s.req.rid, FinishReason.ERROR, code, message, s.generated) for s in self._running.values()]
        outs += [_terminal(r.rid, FinishReason.ERROR, code, message, 0) for r in self._waiting]
        self._running.clear()
        self._uid_of.clear()
        self._waiting.clear()
        return outs

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Expire deadlines, admit waiting requests, run one batch step, report per request."""
        outs = _StepOutputs()
        self._expire(outs)
        self._admit(outs)
        if self._running:
            try:
                tokens = self.backend.step()
            except Exception as exc:
                raise StepFailed(list(outs.by_rid.values())) from exc
            for tok in tokens:
                self._on_token(tok, outs)
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

    def requests(self) -> list[EngineRequest]:
        return list(self._waiting) + [s.req for s in self._running.values()]

    def _admit(self, outs: _StepOutputs) -> None:
        while self._waiting and len(self._running) < self.capacity:
            req = self._waiting.popleft()
            # Only an image request passes images: a backend that takes none keeps its plain insert.
            extra = {} if req.images is None else {"images": req.images}
            try:
                uid = self.backend.insert(
                    req.prompt_tokens,
                    req.params.max_tokens,
                    self._make_sampler(req.params),
                    self._make_processors(req.params),
                    **extra,
                )
            except ValueError as exc:
                outs.by_rid[req.rid] = _terminal(req.rid, FinishReason.ERROR, "bad_request", str(exc), 0)
                continue
            except Exception as exc:
                self._waiting.appendleft(req)  # still owned here, so fail_all() reaches it
                raise StepFailed(list(outs.by_rid.values())) from exc
            self._running[uid] = _Sequence(req, uid, self._new_detokenizer(),
                                            StopMatcher(req.params.stop) if any(req.params.stop) else None)
            self._uid_of[req.rid] = uid
            out = outs.get(req.rid)
            out.started, out.prompt_tokens = True, len(req.prompt_tokens)

    def _on_token(self, tok: GeneratedToken, outs: _StepOutputs) -> None:
        seq = self._running.get(tok.uid)
        if seq is None:  # removed since the step began
            return
        out = outs.get(seq.req.rid)
        if tok.finish_reason == "stop":  # EOS: not part of the text (as mlx_lm.generate)
            self._finish(seq, out, FinishReason.STOP, removed=True)
            return
        seq.generated += 1
        out.token_ids.append(tok.token)
        out.completion_tokens = seq.generated
        seq.detok.add_token(tok.token)
        if _take_text(seq, out):
            self._finish(seq, out, FinishReason.STOP, removed=False, flush=False)
        elif tok.finish_reason == "length":
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
            self.backend.remove([seq.uid])
        self._pop_running(seq.req.rid)
        out.finish, out.completion_tokens = reason, seq.generated

    def _pop_running(self, rid: str) -> _Sequence | None:
        uid = self._uid_of.pop(rid, None)
        return None if uid is None else self._running.pop(uid, None)


def _take_text(seq: _Sequence, out: RequestOutput) -> bool:
    """Add the detokenizer's new text to ``out`` (held back while it may start a stop string); whether a stop
    string appeared. Runs per token: without stop strings it is one append."""
    if seq.stops is None:
        out.text += seq.detok.last_segment
        return False
    result = seq.stops.feed(seq.detok.last_segment)
    out.text += result.text
    return result.stopped


def _terminal(rid: str, reason: FinishReason, code: str | None, message: str, generated: int) -> RequestOutput:
    return RequestOutput(
        rid,
        finish=reason,
        completion_tokens=generated,
        error_code=code,
        error_message=message or None,
    )
