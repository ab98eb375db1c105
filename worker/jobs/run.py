"""One run of a job on a worker, and the builder and numberer of the job's events (start, token, done, error,
reset). A run writes nothing itself: the run table (worker/jobs/table.py) hands its events to the transitions
(worker/jobs/transitions.py), which write them.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mlxq.api.schema import (
    DEFAULT_TENANT,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    Usage,
    token_event_json,
)

if TYPE_CHECKING:
    from .toolcalls import ToolCalls

__all__ = ["Run", "State", "TokenLine", "Wire"]

_RETRYABLE = {ErrorCode.ENGINE_ERROR, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT, ErrorCode.DATA_LOST,
              ErrorCode.EXPIRED}
_MAX_MESSAGE = 2000


class State(enum.Enum):
    """Where a run stands, as this worker knows it."""

    RUNNING = "running"
    CLOSING = "closing"  # its end or hand-back is being written: no other verb may end it
    ENDED = "ended"  # its terminal event is written
    HANDED_BACK = "handed_back"  # its reset is written and the job is queued again
    FENCED = "fenced"  # its lease is gone: another run (or nobody) owns the job now


@dataclass(slots=True)
class TokenLine:
    """A token event as its wire fields. A worker writes one per job per step it sends, so it skips building
    a pydantic ``TokenEvent``; :meth:`model_dump_json` renders exactly that event's JSON."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    index: int
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None
    type: Literal["token"] = "token"

    def model_dump_json(self) -> str:
        if self.logprobs is not None or self.tool_calls is not None:  # rare: pydantic's own JSON
            return TokenEvent(id=self.id, seq=self.seq, text=self.text, token_ids=self.token_ids, index=self.index,
                              reasoning=self.reasoning, logprobs=self.logprobs,
                              tool_calls=self.tool_calls).model_dump_json()
        return token_event_json(self.id, self.seq, self.text, self.token_ids, self.index, self.reasoning)


Wire = Event | TokenLine  # what a run writes


@dataclass(slots=True)
class Run:
    """One run of a job on this worker: its owner token, and the builder and numberer of the job's events.

    ``seq`` is the next event's number; it continues across runs (a run starts after the last logged event).
    """

    rid: str
    queue: str
    owner: str  # the lease's token ("<worker id>:<try>"); "" for the reaper, who owns no run
    attempt: int
    seq: int = 0
    epoch: str = ""  # the deployment's epoch when the run started
    model: str = ""
    enqueue_ms: int = 0
    tenant: str = DEFAULT_TENANT  # whose job it is (its queue says: api.protocol.keys.Keys.queue_of)
    state: State = State.RUNNING
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of its prompt's, those its engine took from the prefix cache
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.time)  # epoch seconds, as the timings below
    admitted_at: float | None = None
    first_token_at: float | None = None
    # Its request asked for log-probabilities: its token events carry them, with each token's text from this
    token_text: Callable[[int], str] | None = None
    tools: ToolCalls | None = None  # its request gave tools: its calls, parsed as they complete
    finished: asyncio.Future[State] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    log_ttl_at: float = 0.0  # when (monotonic) this run's last write set its log's TTL (see Transitions.write)
    keep_s: int | None = None  # how long its result is kept (its request's keep_result_s); None: the default
    # Its text and reasoning so far (bounded by its max_tokens): kept with its end (Transitions: the result record)
    texts: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    _wire: tuple[str, bytes, bytes] | None = field(default=None, repr=False, compare=False)  # see wire_names

    def _next(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def wire_names(self) -> tuple[bytes, bytes]:
        """Its id and owner as an EMIT token append names them, encoded (once: the run writes one per step it
        sends)."""
        cached = self._wire
        if cached is None or cached[0] != self.owner:
            cached = self._wire = (self.owner, self.rid.encode(), self.owner.encode())
        return cached[1], cached[2]

    def settle(self, state: State) -> None:
        """Record how the run left this worker, and wake whoever awaits it."""
        self.state = state
        if not self.finished.done():
            self.finished.set_result(state)

    def start(self, prompt_tokens: int, worker: str, at: float = 0.0, cached_tokens: int = 0) -> StartEvent:
        """The engine admitted the job (``cached_tokens`` of its prompt from the prefix cache): the step that
        did ended ``at`` (epoch s; 0: now)."""
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        if self.admitted_at is None:
            self.admitted_at = at or time.time()
        return StartEvent(id=self.rid, seq=self._next(), model=self.model, worker=worker,
                          prompt_tokens=prompt_tokens, attempt=self.attempt)

    def tokens(self, text: str, token_ids: list[int], completion_tokens: int, reasoning: str = "",
               logprobs: list[TokenLogprob] | None = None, tool_calls: list[ToolCall] | None = None) -> TokenLine:
        """New text (and reasoning, log-probabilities, tool calls): ``completion_tokens`` counts every token so
        far, ``token_ids`` included."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        self.completion_tokens = max(self.completion_tokens, completion_tokens)
        if text:
            self.texts.append(text)
        if reasoning:
            self.thoughts.append(reasoning)
        return TokenLine(self.rid, self._next(), text, token_ids, completion_tokens - len(token_ids), reasoning,
                         logprobs, tool_calls)

    def done(self, reason: FinishReason, *, generated: int = 0, stop_sequence: str | None = None,
             embeddings: list[str] | None = None) -> DoneEvent:
        """The job's end: ``generated`` tokens at least (the engine's count), ``stop_sequence`` the stop string
        that ended it, if one did; one that stopped after tool calls ends ``tool_calls``, with every call; an
        embedding job's vectors (base64 float32) in ``embeddings``."""
        self.completion_tokens = max(self.completion_tokens, generated)
        calls = self.tools.calls if self.tools is not None and self.tools.calls else None
        if calls and reason is FinishReason.STOP:
            reason = FinishReason.TOOL_CALLS
        return DoneEvent(id=self.rid, seq=self._next(), finish_reason=reason, timings=self.timings(),
                         usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                                     cached_tokens=self.cached_tokens),
                         stop_sequence=stop_sequence, tool_calls=list(calls) if calls else None, tenant=self.tenant,
                         embeddings=embeddings)

    def error(self, code: ErrorCode, message: str) -> ErrorEvent:
        if len(message) > _MAX_MESSAGE:
            message = message[:_MAX_MESSAGE] + "..."
        return ErrorEvent(id=self.rid, seq=self._next(), code=code, message=message, retryable=code in _RETRYABLE)

    def reset(self, reason: str) -> ResetEvent:
        """The job starts again (in the next run, ``attempt + 1``): its followers drop the text so far."""
        return ResetEvent(id=self.rid, seq=self._next(), reason=reason, attempt=self.attempt + 1)

    def timings(self) -> Timings:
        now = time.time()
        enqueued = self.enqueue_ms / 1000
        ms = lambda t: max(0.0, (t - enqueued) * 1000.0)  # noqa: E731
        decode_s = now - self.first_token_at if self.first_token_at else 0.0
        tps = (self.completion_tokens - 1) / decode_s if decode_s > 0 and self.completion_tokens > 1 else None
        return Timings(queue_ms=ms(self.admitted_at or now), total_ms=ms(now), tokens_per_s=tps,
                       ttft_ms=ms(self.first_token_at) if self.first_token_at else None)

