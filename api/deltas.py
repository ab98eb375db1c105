"""A job's events as deltas: its new text, reasoning, log-probabilities and tool calls, each piece once; or
as a whole (:class:`Whole`, the last run's parts).

A reset (the job re-runs after its worker was lost or shut down) must not corrupt what a reader receives. The
new run's repeat of what was already given (greedy decoding repeats it exactly) is skipped; a new run that
diverges from it (sampling) raises :class:`~api.errors.JobFailed`, never text that no longer holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import JobFailed
from .schema import DoneEvent, ErrorCode, ErrorEvent, Event, TokenLogprob, ToolCall

__all__ = ["Delta", "Deltas", "Whole", "diverged"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Delta:
    """What a job made since the last delta."""

    text: str
    reasoning: str = ""  # a reasoning model's thinking, for a request with reasoning="split"
    logprobs: tuple[TokenLogprob, ...] = ()  # its new tokens' log-probabilities, for a request with logprobs
    tool_calls: tuple[ToolCall, ...] = ()  # the tool calls completed, for a request with tools


class Deltas:
    """Turns one job's events, in order, into deltas: :meth:`feed` each event, :meth:`end` at its end."""

    __slots__ = ("_calls", "_logprobs", "_reasoning", "_text", "rid")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._text, self._reasoning = _Sent(), _Sent()
        self._logprobs: _Counted[TokenLogprob] = _Counted()
        self._calls: _Counted[ToolCall] = _Counted()

    def feed(self, ev: Event) -> Delta | None:
        """The delta ``ev`` brings (None: nothing new); :class:`JobFailed` when a re-run diverged."""
        if ev.type == "reset":
            for sent in (self._text, self._reasoning, self._logprobs, self._calls):
                sent.rerun()
            return None
        if ev.type != "token" or not (ev.text or ev.reasoning or ev.logprobs or ev.tool_calls):
            return None
        reasoning, text = self._reasoning.take(ev.reasoning), self._text.take(ev.text)
        if reasoning is None or text is None:
            raise JobFailed(diverged(self.rid, ev.seq))
        logprobs, calls = self._logprobs.take(ev.logprobs or ()), self._calls.take(ev.tool_calls or ())
        if text or reasoning or logprobs or calls:
            return Delta(text, reasoning, logprobs, calls)
        return None

    def end(self, seq: int) -> None:
        """The job ended (its terminal event ``seq``): :class:`JobFailed` when a re-run ended short of what was
        given."""
        if self._text.short or self._reasoning.short:
            raise JobFailed(diverged(self.rid, seq))


class Whole:
    """One job's parts, gathered from its events in order: the last run's text, reasoning, token ids and
    log-probabilities (a reset starts them over), and the tool calls its end carries."""

    __slots__ = ("_reasoning", "_text", "logprobs", "token_ids", "tool_calls")

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None  # None while no token carried any
        self.tool_calls: list[ToolCall] = []

    def feed(self, ev: Event) -> None:
        if ev.type == "reset":
            self._text, self._reasoning, self.token_ids, self.logprobs = [], [], [], None
        elif ev.type == "token":
            self._text.append(ev.text)
            self._reasoning.append(ev.reasoning)
            self.token_ids.extend(ev.token_ids)
            if ev.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(ev.logprobs)
        elif isinstance(ev, DoneEvent):
            self.tool_calls = list(ev.tool_calls or ())

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)


def diverged(rid: str, seq: int) -> ErrorEvent:
    """The error a reader gets when a re-run's text differs from what it was given."""
    return ErrorEvent(id=rid, seq=seq, code=ErrorCode.INTERNAL, retryable=True,
                      message="the job restarted on another worker and its new text differs from the text "
                              "already streamed (sampling without a seed does not repeat)")


class _Sent:
    """One text channel given so far, against which a re-run's repeat is matched. The pieces are joined only
    when a re-run needs them: a reader appends one per event."""

    __slots__ = ("_len", "_parts", "_pos")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._len = 0
        self._pos = 0  # how far into what was given the current run has come

    def rerun(self) -> None:
        self._pos = 0

    def take(self, piece: str) -> str | None:
        """What of ``piece`` is new; None when it contradicts what was given."""
        if not piece:
            return ""
        if self._pos < self._len:  # a re-run repeating what was given: it must match
            sent = "".join(self._parts)
            self._parts = [sent]
            overlap = sent[self._pos : self._pos + len(piece)]
            if not piece.startswith(overlap):
                return None
            self._pos += len(overlap)
            piece = piece[len(overlap) :]
            if not piece:
                return ""
        self._parts.append(piece)
        self._len += len(piece)
        self._pos += len(piece)
        return piece

    @property
    def short(self) -> bool:
        return self._pos < self._len


class _Counted(Generic[T]):
    """A channel of items (log-probabilities, tool calls) given so far, counted: a re-run's first items repeat
    those given (greedy decoding) and are skipped."""

    __slots__ = ("_seen", "_sent")

    def __init__(self) -> None:
        self._sent = self._seen = 0  # items given, and seen of the current run

    def rerun(self) -> None:
        self._seen = 0

    def take(self, items: Sequence[T]) -> tuple[T, ...]:
        new = tuple(items[max(0, self._sent - self._seen):])
        self._seen += len(items)
        self._sent = max(self._sent, self._seen)
        return new
