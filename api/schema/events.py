"""The wire schema's events: what a job emits, in order, ending in exactly one terminal event.

Events form one discriminated union on ``type``; each carries the request id and a per-request sequence number
``seq`` (0, 1, 2, ...) so subscribers can merge live pub/sub with the replay log.
"""

from __future__ import annotations

import base64
import sys
from array import array
from enum import Enum
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .requests import ToolCall

__all__ = [
    "EVENTS",
    "TERMINAL_TYPES",
    "DoneEvent",
    "ErrorCode",
    "ErrorEvent",
    "Event",
    "FinishReason",
    "ResetEvent",
    "StartEvent",
    "Timings",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "decode_event",
    "decode_vector",
    "is_terminal",
    "token_event_json",
]


class FinishReason(str, Enum):
    """Why a sequence ended without an error."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # a client cancelled it
    TOOL_CALLS = "tool_calls"  # the model called tools (the done event's tool_calls), then stopped


class ErrorCode(str, Enum):
    """Machine-readable error codes carried by :class:`ErrorEvent`."""

    BAD_REQUEST = "bad_request"  # the job can never succeed as sent
    TIMEOUT = "timeout"  # the job ran past its deadline
    ENGINE_ERROR = "engine_error"  # the engine failed while this job was in flight
    WORKER_LOST = "worker_lost"  # the worker running it died and no tries remain
    DATA_LOST = "data_lost"  # Redis lost the job's data while it ran (restarted without persistence, flushed)
    EXPIRED = "expired"  # it was still queued when its expiry passed (no worker took it in time)
    INTERNAL = "internal"  # a bug: the message says what
    MODEL_UNAVAILABLE = "model_unavailable"  # its model (loaded on demand) could not be loaded: files missing, corrupt


class Usage(BaseModel):
    """Token counts of one finished job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int
    completion_tokens: int
    # Of the prompt's tokens, those the worker's prefix cache held (not prefilled again). Left out of the JSON
    # when 0, so a producer of an earlier release reads a new worker's event without a hit.
    cached_tokens: int = Field(default=0, exclude_if=lambda v: not v)


class Timings(BaseModel):
    """Where a job's time went, in milliseconds (``tokens_per_s`` is completion tokens over decode time)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_ms: float  # enqueue -> the engine admitted it
    ttft_ms: float | None  # enqueue -> first token published (None if no token was made)
    total_ms: float  # enqueue -> terminal event
    tokens_per_s: float | None


class _EventBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    seq: int = Field(ge=0)


class StartEvent(_EventBase):
    """The engine admitted the job; ``prompt_tokens`` is the tokenized prompt length."""

    type: Literal["start"] = "start"
    model: str
    worker: str
    prompt_tokens: int
    attempt: int = 1


class TopLogprob(BaseModel):
    """One of the most likely tokens at a generated token's place: its id, log-probability and text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: int
    logprob: float
    text: str = ""


class TokenLogprob(BaseModel):
    """A generated token's log-probability and text, and the most likely tokens at its place, most likely first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: int
    logprob: float
    text: str = ""
    top: list[TopLogprob] = Field(default_factory=list)


class TokenEvent(_EventBase):
    """New text: ``text`` is the delta, ``token_ids`` the tokens behind it, ``index`` the first one's index;
    ``reasoning``: new reasoning text, apart from the answer's (only for a request with ``reasoning="split"``)."""

    type: Literal["token"] = "token"
    text: str
    token_ids: list[int]
    index: int
    reasoning: str = Field(default="", exclude_if=lambda v: not v)  # left out when empty, as before it was
    # One per token of ``token_ids``, for a request with ``logprobs`` (left out otherwise).
    logprobs: list[TokenLogprob] | None = Field(default=None, exclude_if=lambda v: v is None)
    # The tool calls the model completed with these tokens (for a request with tools; left out otherwise).
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


def token_event_json(id: str, seq: int, text: str, token_ids: list[int], index: int, reasoning: str = "") -> str:
    """``TokenEvent(...).model_dump_json()``, byte for byte (a property test holds it to that), without
    building the model: a worker makes one per job per published step."""
    ids = ",".join(map(str, token_ids))
    tail = f',"reasoning":{encode_basestring(reasoning)}}}' if reasoning else "}"
    return (f'{{"id":{encode_basestring(id)},"seq":{seq},"type":"token","text":{encode_basestring(text)},'
            f'"token_ids":[{ids}],"index":{index}{tail}')


class ResetEvent(_EventBase):
    """The job is being run again from the start: drop the text received so far."""

    type: Literal["reset"] = "reset"
    reason: str
    attempt: int


class DoneEvent(_EventBase):
    """Terminal: the job finished. Exactly one terminal event (done or error) ends every job.
    ``stop_sequence``: the stop string (one of the request's ``stop``) that ended it, if one did."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    # Left out of the JSON when None, so a producer of an earlier release reads a new worker's event.
    stop_sequence: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # Every tool call of the job, in order (finish_reason tool_calls when it stopped after them).
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)
    # Whose job it was (GenerateRequest.tenant); None from a worker of an earlier release.
    tenant: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # An embedding job's vectors, one per input in order, each base64 of little-endian float32 values (OpenAI's
    # base64 encoding_format: compact on the wire); left out for a generation job.
    embeddings: list[str] | None = Field(default=None, exclude_if=lambda v: v is None)


class ErrorEvent(_EventBase):
    """Terminal: the job failed. ``retryable`` says whether submitting it again may succeed."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    retryable: bool = False


Event = Annotated[
    Union[StartEvent, TokenEvent, ResetEvent, DoneEvent, ErrorEvent],  # noqa: UP007 (needs a runtime Union)
    Field(discriminator="type"),
]
EVENTS: TypeAdapter[Event] = TypeAdapter(Event)
TERMINAL_TYPES = frozenset({"done", "error"})


def decode_event(data: bytes | str) -> Event:
    """Parse one JSON event as published on a job channel or stored in its replay log."""
    # The core validator: the TypeAdapter's Python wrapper costs more per event, and clients decode many.
    event: Event = EVENTS.validator.validate_json(data)
    return event


def is_terminal(event: Event) -> bool:
    """Whether ``event`` ends its job."""
    return event.type in TERMINAL_TYPES


def decode_vector(data: str) -> list[float]:
    """One vector of a done event's ``embeddings``: base64 of little-endian float32 values, as floats."""
    values = array("f", base64.b64decode(data))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
