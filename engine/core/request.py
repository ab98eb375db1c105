"""Engine-side records: a request as the scheduler sees it, and what one step reports about it.

These know nothing of the wire schema or Redis; ``worker/jobs/translate.py`` maps between the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from .parts import PartMarkers

__all__ = ["EngineRequest", "ErrorCode", "FinishReason", "Format", "ImageInputs", "RequestOutput", "SamplingParams",
           "Status", "TokenLogprob", "coalesce", "merge_into", "terminal"]


class Status(str, Enum):
    """Where a request is in the engine. It ends in exactly one of the terminal states."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class FinishReason(str, Enum):
    """How a request ended. ``ERROR`` comes with an error code and message."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class ErrorCode(str, Enum):
    """Why the engine ended a request with ``FinishReason.ERROR`` (the worker maps each to a wire code)."""

    BAD_REQUEST = "bad_request"  # it cannot run here as sent (beyond the context or KV headroom; its format)
    TIMEOUT = "timeout"  # it ran past its deadline
    ENGINE_ERROR = "engine_error"  # the batch failed while it was in flight


_COLDEST = 1e-30  # a lower temperature samples greedily


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives (None: none)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that a draw is its argmax anyway (and 1/T would overflow float32)."""
        return self.temperature < _COLDEST


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """A prompt's images as the model's processor prepared them, off the engine thread: numpy arrays only
    (e.g. ``pixel_values``, ``image_grid_thw``), no MLX array. The prompt's tokens already hold the image
    placeholders; the engine embeds the images on its own thread when the request joins the batch."""

    arrays: Mapping[str, Any]  # name -> numpy array, as the model's get_input_embeddings takes them
    count: int  # images in the prompt


class Format(Protocol):
    """A compiled output format (``engine/mlx/constrain.py``'s ``Grammar``): each row it constrains gets its own
    mask."""

    def row(self) -> Any: ...


@dataclass(slots=True)
class EngineRequest:
    """One sequence to generate. ``arrival`` and ``deadline`` are ``time.monotonic()`` values (an arrival of
    0.0 means "when the scheduler gets it").

    ``priority``: higher goes first, with aging (``engine/core/waiting.py``), and may preempt lower-priority
    sequences. ``cache_boundary``: how many leading prompt tokens are a reusable prefix (the chat template's
    system prompt, see ``engine/core/prompt.py``); the engine caches their KV there. 0: none. ``images``: the
    prompt's images, for a model that accepts them (None: a text prompt). ``format``: what its output must
    match (None: free text). ``parts``: the model's think and tool-call markers, to report reasoning and tool calls
    apart from the answer (None: one text). ``group`` and ``weight``: who it is for (a tenant) and that group's
    weight: between groups, the batch is shared by weight (``engine/core/shares.py``), priority orders within one.
    """

    rid: str
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    deadline: float | None = None
    priority: int = 0
    cache_boundary: int = 0
    images: ImageInputs | None = None
    format: Format | None = None
    parts: PartMarkers | None = None
    group: str = ""
    weight: float = 1.0
    affinity: str = ""  # an opaque key of the caller's for prompts alike (its prefix affinity): see PrefixCache.tag
    bulk: bool = False  # the bulk band: waits behind every other request however long (waiting.priority_key)
    system_key: str = ""  # the caller's key for its system prompt alone (``cache_boundary``), shared by prompts


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability, and the ``top`` most likely tokens at its place (id, log-probability),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """What one engine step reports about one request.

    ``text`` is the new text (held back while it could be the start of a stop string), ``reasoning`` the new
    reasoning text and ``calls`` the text of each tool call completed (with ``EngineRequest.parts``);
    ``token_ids`` the tokens generated this step.
    ``finish`` is set exactly once, on the request's last output; ``stop_sequence`` with it, when a stop
    string (that one) ended the request.
    """

    rid: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    started: bool = False  # first output after admission: prompt_tokens (and cached_tokens) are set
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far, this step's included
    finish: FinishReason | None = None
    error_code: ErrorCode | None = None  # with FinishReason.ERROR
    error_message: str | None = None
    stop_sequence: str | None = None
    reasoning: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token of ``token_ids``, when asked
    calls: list[str] = field(default_factory=list)
    started_at: float = 0.0  # with ``started``: when its step handed it over (epoch s; the pacer stamps it)
    # An embedding request's vectors, with its finish: one per input, each little-endian float32 bytes
    # (engine/core/embedding.py); None for a generation request.
    embeddings: list[bytes] | None = None
    cached_tokens: int = 0  # with ``started``: how many of its prompt tokens came from the prefix cache


def terminal(rid: str, reason: FinishReason, generated: int, code: ErrorCode | None = None,
             message: str = "") -> RequestOutput:
    """The last output of a request ended outside a decode step (aborted, refused, failed)."""
    return RequestOutput(rid, finish=reason, completion_tokens=generated, error_code=code,
                         error_message=message or None)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Merge several steps' outputs into one per request (in first-seen order), as if from one step.

    When the consumer falls behind the engine (tiny models step in about a millisecond), this turns many
    small token events into a few larger ones instead of queueing work per token. The inputs are not changed.
    """
    if len({out.rid for out in outputs}) == len(outputs):
        return list(outputs)  # the common case, one output per request (the engine's pacer merged them)
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        acc = merged.get(out.rid)
        if acc is None:
            merged[out.rid] = RequestOutput(
                out.rid, list(out.token_ids), out.text, out.started, out.prompt_tokens,
                out.completion_tokens, out.finish, out.error_code, out.error_message, out.stop_sequence,
                out.reasoning, list(out.logprobs), list(out.calls), out.started_at, out.embeddings,
                out.cached_tokens,
            )
        else:
            merge_into(acc, out)
    return list(merged.values())


def merge_into(acc: RequestOutput, out: RequestOutput) -> None:
    """Fold a later output of the same request into ``acc`` (nothing follows a request's end)."""
    if acc.finish is not None:
        return
    acc.token_ids.extend(out.token_ids)
    acc.text += out.text
    if out.reasoning:
        acc.reasoning += out.reasoning
    if out.logprobs:
        acc.logprobs.extend(out.logprobs)
    if out.calls:
        acc.calls.extend(out.calls)
    acc.completion_tokens = max(acc.completion_tokens, out.completion_tokens)
    if out.finish is None and not out.started:  # a plain decode step: the common case, per token
        return
    acc.started = acc.started or out.started
    acc.started_at = acc.started_at or out.started_at
    acc.prompt_tokens = acc.prompt_tokens or out.prompt_tokens
    acc.cached_tokens = acc.cached_tokens or out.cached_tokens
    acc.finish, acc.error_code, acc.error_message = out.finish, out.error_code, out.error_message
    acc.stop_sequence = out.stop_sequence
    acc.embeddings = out.embeddings if out.embeddings is not None else acc.embeddings
