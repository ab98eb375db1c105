"""One row of the batch: what happens to its tokens after the model made them.

A :class:`Sequence` accepts one token or several at once (a decode step gives one, a speculative step
several), feeds them to its streaming detokenizer and stop strings, and writes into the step's
:class:`~engine.core.request.RequestOutput` the tokens, the text to emit and, once, how it ended. A row may hold a
:class:`Constraint`, the mask its next token is sampled under (the backend applies it), and a
:class:`~engine.core.parts.PartSplitter` that puts its reasoning and tool calls apart from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .backend import SequenceCache
from .parts import Parts, PartSplitter
from .request import EngineRequest, FinishReason, RequestOutput
from .stops import StopMatcher

__all__ = ["Constraint", "Detokenizer", "Sequence"]

EOS = "stop"  # a backend's finish for a token that is the end of sequence (not part of the text)
LENGTH = "length"  # a backend's finish at max_tokens


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface (one instance per sequence)."""

    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


class Constraint(Protocol):
    """What a row's next token may be (constrained decoding): a logits processor of mlx-lm's form that the
    backend recognises, so it masks every constrained row's logits in one operation per step, advancing each
    by the tokens its row is fed. Once the constraint is complete it allows only an end of sequence."""

    def __call__(self, tokens: Any, logits: Any) -> Any: ...
    @property
    def error(self) -> str: ...  # why it cannot go on ("" while it can)


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's row: its tokens, text and end, and what the scheduler keeps to run and resume it."""

    req: EngineRequest
    detok: Detokenizer
    key: float  # waiting-queue key (lower first)
    order: int  # first come, first served within a key
    stops: StopMatcher | None = None  # None without stop strings
    constraint: Constraint | None = None
    splitter: PartSplitter | None = None  # reasoning and tool calls apart from the answer
    uid: int = -1  # in the batch; -1 while waiting
    generated: int = 0
    admitted: bool = False  # has started (a later admission is a resume)
    finish: FinishReason | None = None
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    history: list[int] | None = None  # the generated tokens, kept once they may be needed for a recompute
    parked: SequenceCache | None = None  # its KV cache while preempted
    parked_bytes: int = 0
    plain: bool = False  # neither log-probabilities nor a format: its tokens take the scheduler's short way
    cached: int = 0  # prompt tokens its first admission took from the prefix cache (its usage reports them)
    equipped: bool = False  # has its sampler and processors (equip())

    @classmethod
    def of(cls, req: EngineRequest, detok: Detokenizer, key: float, order: int) -> Sequence:
        stops = StopMatcher(req.params.stop) if any(req.params.stop) else None
        splitter = PartSplitter(req.parts) if req.parts is not None else None
        return cls(req, detok, key, order, stops, splitter=splitter)

    def equip(self, sampler: Any, processors: list[Any]) -> None:
        """Give a new sequence its sampler and logits processors, and its format's constraint first among them
        (its mask goes to the backend with its other processors)."""
        self.sampler, self.processors, self.equipped = sampler, processors, True
        if self.req.format is not None:
            self.constraint = self.req.format.row()
            self.processors = [self.constraint, *processors]
        self.plain = self.constraint is None and self.req.params.logprobs is None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def end(self) -> int:
        """The most tokens its cache can hold: prompt + max_tokens."""
        return len(self.req.prompt_tokens) + self.req.params.max_tokens

    @property
    def length(self) -> int:
        """Tokens in its cache once the last one generated is fed: prompt + generated."""
        return len(self.req.prompt_tokens) + self.generated

    @property
    def remaining(self) -> int:
        return self.req.params.max_tokens - self.generated

    def accept(self, token: int, end: str | None, out: RequestOutput) -> FinishReason | None:
        """Take one token; ``end`` is the backend's finish for it (:data:`EOS`: it is the end of sequence and
        no part of the text; :data:`LENGTH`). How the row ended with it, or None while it goes on."""
        if end == EOS:
            return self._end(out, FinishReason.STOP)
        self.generated += 1
        if self.history is not None:
            self.history.append(token)
        out.token_ids.append(token)
        out.completion_tokens = self.generated
        detok = self.detok
        detok.add_token(token)
        if self.stops is None and self.splitter is None:  # the common case: the new text, as it is
            out.text += detok.last_segment
        elif self._take_text(out):
            return self._end(out, FinishReason.STOP, flush=False)
        if end == LENGTH or self.generated >= self.req.params.max_tokens:
            return self._end(out, FinishReason.LENGTH)
        return None

    def _take_text(self, out: RequestOutput) -> bool:
        """Add the detokenizer's new text to ``out`` (held back while it may start a stop string); whether a
        stop string appeared (``out.stop_sequence`` names it). Per token: without stops or parts, one append."""
        if self.stops is None:
            self._emit(out, self.detok.last_segment)
            return False
        result = self.stops.feed(self.detok.last_segment)
        self._emit(out, result.text)
        out.stop_sequence = result.stop
        return result.stopped

    def _emit(self, out: RequestOutput, text: str) -> None:
        """Text past the stop strings, split into its parts (answer, reasoning, tool calls) when asked."""
        if self.splitter is None:
            out.text += text
        else:
            _put(out, self.splitter.feed(text))

    def _end(self, out: RequestOutput, reason: FinishReason, *, flush: bool = True) -> FinishReason:
        if flush:
            self.detok.finalize()
            if self._take_text(out):
                reason = FinishReason.STOP
            elif self.stops is not None:
                self._emit(out, self.stops.flush())
        if self.splitter is not None:
            _put(out, self.splitter.flush())
        self.finish = out.finish = reason
        out.completion_tokens = self.generated
        return reason


def _put(out: RequestOutput, parts: Parts) -> None:
    out.text += parts.answer
    out.reasoning += parts.reasoning
    if parts.calls:
        out.calls.extend(parts.calls)
