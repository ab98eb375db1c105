"""OpenAI's API over the queue: ``/v1/chat/completions`` and ``/v1/completions``, requests in and responses out.

Mapped: the messages (``developer`` is a system turn) or prompt, the sampling fields (and mlx-lm's and vLLM's
``top_k``, ``min_p``, ``repetition_penalty``, mlxq's ``priority``), ``stop``, ``metadata``, ``user``,
``prompt_cache_key`` (which worker's prefix cache a job prefers), streaming with
``stream_options.include_usage``; ``response_format`` (and mlxq's ``regex`` and ``grammar``); reasoning as
``reasoning_content`` (``chat_template_kwargs.enable_thinking``); ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (a streamed call comes whole in one delta); ``image_url`` parts; both APIs'
``logprobs``; ``n`` up to 8, one job per choice (``seed + i`` for choice i). Refused with a 400 that names
them: ``functions``/``function_call``, ``logit_bias``, audio, ``echo``, ``suffix``, ``best_of`` > 1 and
token-id prompts.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import describe
from ..schema import ChatMessage, FinishReason, GenerateRequest, TokenLogprob, ToolCall
from .config import GatewayConfig, max_tokens_fields
from .content import chat_content
from .dialect import Ask, dumps, sse
from .errors import GatewayError, Kind, Problem, invalid, validation_problem
from .job import Choices, Delta, JobStream
from .sse import Last

__all__ = ["CHAT", "COMPLETIONS", "ChatDialect", "CompletionDialect", "openai_error"]

_DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {Kind.INVALID: "invalid_request_error", Kind.UNAUTHORIZED: "authentication_error",
                Kind.NOT_FOUND: "invalid_request_error", Kind.TOO_LARGE: "invalid_request_error",
                Kind.RATE_LIMITED: "rate_limit_error", Kind.UPSTREAM: "server_error",
                Kind.UNAVAILABLE: "service_unavailable_error"}
MAX_CHOICES = 8  # n: one job per choice
_SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "priority")


# --- requests --------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Common(BaseModel):
    """The fields both endpoints share. Unknown fields are refused (as OpenAI does), so none is silently lost."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Extensions mlx_lm.server and vLLM accept, and the queue's own priority.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    # OpenAI's routing hint: a conversation's jobs prefer the worker whose prefix cache holds its start.
    prompt_cache_key: str | None = None
    # Accepted and without effect here.
    service_tier: str | None = None
    store: bool | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # refusal, audio: nothing to map them to

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; enable_thinking is the one taken


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[Any]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def _refusals(body: _Common) -> list[str]:
    """What the request asks for that the gateway does not do."""
    out = []
    if body.logit_bias:
        out.append("logit_bias")
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            out.append("top_logprobs without logprobs: true")
        if body.functions or body.function_call:
            out.append("functions and function_call (use tools and tool_choice)")
        if (body.modalities and set(body.modalities) != {"text"}) or body.audio:
            out.append("audio output")
        if body.prediction:
            out.append("prediction")
        unknown = sorted(set(body.chat_template_kwargs or {}) - {"enable_thinking"})
        if unknown:
            out.append(f"chat_template_kwargs {', '.join(unknown)} (only enable_thinking)")
    if isinstance(body, CompletionRequest):
        if body.echo:
            out.append("echo")
        if body.suffix:
            out.append("suffix")
        if body.best_of not in (None, 1):
            out.append("best_of > 1")
    return out


def _parse(model: type[_Common], body: bytes | dict[str, Any]) -> Any:
    try:
        parsed = model.model_validate(body) if isinstance(body, dict) else model.model_validate_json(body)
    except ValidationError as exc:
        raise GatewayError(validation_problem(exc)) from None
    refused = _refusals(parsed)
    if refused:
        raise invalid(f"not supported by this server: {', '.join(refused)}", "unsupported_parameter")
    return parsed


def _job(body: _Common, config: GatewayConfig, max_tokens: int | None, **prompt: Any) -> Ask:
    """The job: the prompt given, the sampling fields set; with no ``max_tokens``, the default, lowered by the
    worker to what fits the model's context after the prompt (OpenAI's API: up to the context)."""
    fields: dict[str, Any] = {name: v for name in _SAMPLING if (v := getattr(body, name)) is not None}
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    metadata = dict(body.metadata or {})
    if body.user:
        metadata.setdefault("user", body.user)
    if body.prompt_cache_key is not None:
        fields["prompt_cache_key"] = body.prompt_cache_key
    try:
        req = GenerateRequest(model=body.model, **max_tokens_fields(max_tokens, config.default_max_tokens),
                              stop=[s for s in stops if s], metadata=metadata, **fields, **prompt)
    except ValidationError as exc:
        raise GatewayError(validation_problem(exc)) from None
    usage = body.stream_options is not None and body.stream_options.include_usage
    return Ask(req, body.stream, usage, body.n or 1)


def _messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "function":
            raise invalid(f"{where}: the legacy function role is not supported (use tool)", "unsupported_parameter")
        role = "system" if m.role == "developer" else m.role
        try:
            calls = [ToolCall.model_validate(c) for c in m.tool_calls] if m.tool_calls else None
            out.append(ChatMessage(role=role, content=chat_content(m.content, where), tool_calls=calls,
                                   tool_call_id=m.tool_call_id, name=m.name if role == "tool" else None))
        except ValidationError as exc:
            raise invalid(f"{where}: {describe(exc)}", "invalid_request_error") from None
    return out


def _prompt(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise invalid("prompt: one string per request (no batches, no token ids)", "unsupported_parameter")


# --- responses -------------------------------------------------------------------------------------
def _finish(reason: FinishReason) -> str:
    if reason is FinishReason.TOOL_CALLS:
        return "tool_calls"
    return "length" if reason is FinishReason.LENGTH else "stop"


def _calls(calls: Sequence[ToolCall], first: int | None = None) -> list[dict[str, Any]]:
    """A message's ``tool_calls`` (a stream's delta numbers them from ``first``)."""
    out = [c.model_dump() for c in calls]
    if first is not None:
        out = [{"index": first + i, **c} for i, c in enumerate(out)]
    return out


def _usage(jobs: Choices) -> dict[str, Any]:
    """The request's usage: its prompt once (with the tokens of it the worker's prefix cache held), every
    choice's completion."""
    assert jobs.first.done is not None
    first, completion = jobs.first.done.usage, jobs.completion_tokens
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def _logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A choice's ``logprobs``: each token's text, log-probability, UTF-8 bytes and its top alternatives."""
    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(lp.text, lp.logprob), "top_logprobs": [one(t.text, t.logprob) for t in lp.top]}
                        for lp in entries], "refusal": None}


def _text_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy form): tokens, their log-probabilities, each place's top
    alternatives and each token's offset in the text (from ``offset``)."""
    offsets = []
    for lp in entries:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in entries], "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in entries], "text_offset": offsets}


def openai_error(problem: Problem) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": problem.message, "type": _ERROR_TYPES[problem.kind], "param": None,
                      "code": problem.code}}


class _OpenAI:
    """What both endpoints render alike: errors, and a stream's frames around its text chunks."""

    name = "openai"
    object_prefix = ""
    chunk_object = ""

    def error_body(self, problem: Problem) -> dict[str, Any]:
        return openai_error(problem)

    def error_frame(self, problem: Problem) -> bytes:
        return Last(sse(dumps(openai_error(problem))) + _DONE)

    def _head(self, ask: Ask, jobs: Choices, created: int) -> str:
        """A chunk's JSON up to its ``choices`` (and after them, ``usage: null`` when usage comes last)."""
        return (f'{{"id":"{self.object_prefix}{jobs.rid}","object":"{self.chunk_object}","created":{created},'
                f'"model":{encode_basestring(ask.request.model)},"system_fingerprint":null,"choices":')

    def _tail(self, ask: Ask) -> str:
        return ',"usage":null}' if ask.include_usage else "}"

    def _start(self, index: int) -> str | None:
        return None

    def _text(self, index: int, delta: Delta, sent: _Sent) -> str:
        raise NotImplementedError

    def _last(self, index: int, reason: str, sent: _Sent) -> str:
        raise NotImplementedError

    async def frames(self, ask: Ask, jobs: Choices) -> AsyncIterator[bytes]:
        # Frames that go out together are joined into one write: each write is a send (a system call, and a
        # wake-up of the reader) and a pass through the HTTP stack.
        created = int(time.time())
        head, tail = self._head(ask, jobs, created), self._tail(ask)
        starts = [self._start(i) for i in range(len(jobs.jobs))]
        opening = "".join(f"data: {head}[{start}]{tail}\n\n" for start in starts if start is not None)
        sent = [_Sent(ask.request.calls_tools) for _ in jobs.jobs]
        async for i, delta in jobs.deltas():
            yield f"{opening}data: {head}[{self._text(i, delta, sent[i])}]{tail}\n\n".encode()
            opening = ""
            sent[i].add(delta)
        closing = [opening]
        for i, job in enumerate(jobs.jobs):
            assert job.done is not None
            closing.append(f"data: {head}[{self._last(i, _finish(job.done.finish_reason), sent[i])}]{tail}\n\n")
        if ask.include_usage:
            closing.append(f'data: {head}[],"usage":{dumps(_usage(jobs))}}}\n\n')
        yield Last("".join(closing).encode() + _DONE)


class _Sent:
    """What a stream sent of one choice: its tool calls (numbered across the choice) and the length of its tokens'
    texts (the legacy logprobs' offsets, counted as the whole response counts them: by the tokens, whatever text
    the detokenizer held back at a chunk's end); and, for a request with tools, the whitespace held back until
    what follows it shows whether it is content (more text) or lies beside calls (none, as OpenAI's)."""

    __slots__ = ("calls", "held", "holds", "offset")

    def __init__(self, holds: bool = False) -> None:
        self.calls = self.offset = 0
        self.holds, self.held = holds, ""

    def content(self, delta: Delta) -> str:
        """The content to send of ``delta``'s text."""
        if not self.holds:
            return delta.text
        text, self.held = self.held + delta.text, ""
        if text.strip():
            return text
        if not delta.tool_calls:
            self.held = text
        return ""

    def add(self, delta: Delta) -> None:
        self.calls += len(delta.tool_calls)
        self.offset += sum(len(lp.text) for lp in delta.logprobs)


class ChatDialect(_OpenAI):
    """``POST /v1/chat/completions``."""

    name = "chat"
    object_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def parse(self, body: bytes | dict[str, Any], config: GatewayConfig) -> Ask:
        """A request's body (its JSON, or that JSON already parsed: a translation's, the Responses API's)."""
        req: ChatRequest = _parse(ChatRequest, body)
        fmt = req.response_format
        extra: dict[str, Any] = {"response_format": fmt} if fmt and fmt.get("type") != "text" else {}
        extra["reasoning"] = "split"  # a reasoning model's thinking goes out as reasoning_content
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is not None:
            extra["enable_thinking"] = thinking
        if req.logprobs:
            extra["logprobs"] = req.top_logprobs or 0
        if req.tools:
            extra["tools"] = req.tools
            if req.tool_choice is not None:
                extra["tool_choice"] = req.tool_choice
            if req.parallel_tool_calls is not None:
                extra["parallel_tool_calls"] = req.parallel_tool_calls
        elif req.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice requires tools", "invalid_request_error")
        return _job(req, config, req.max_completion_tokens or req.max_tokens, messages=_messages(req.messages),
                    **extra)

    def response(self, ask: Ask, jobs: Choices, texts: list[str]) -> dict[str, Any]:
        choices = [self._choice(ask, i, job, text) for i, (job, text) in enumerate(zip(jobs.jobs, texts))]
        return {"id": f"chatcmpl-{jobs.rid}", "object": "chat.completion", "created": int(time.time()),
                "model": ask.request.model, "system_fingerprint": None, "choices": choices, "usage": _usage(jobs)}

    def _choice(self, ask: Ask, index: int, job: JobStream, text: str) -> dict[str, Any]:
        assert job.done is not None
        # With calls, whitespace the model wrote around them is no answer: content null, as OpenAI's.
        content = text if text.strip() or not job.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if job.reasoning:
            message["reasoning_content"] = job.reasoning
        if job.tool_calls:
            message["tool_calls"] = _calls(job.tool_calls)
        logprobs = _logprobs(job.logprobs) if ask.request.logprobs is not None else None
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish(job.done.finish_reason)}

    def _start(self, index: int) -> str:
        return f'{{"index":{index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}'

    def _text(self, index: int, delta: Delta, sent: _Sent) -> str:
        fields = []
        if delta.reasoning:  # vLLM's and DeepSeek's field for a reasoning model's thinking
            fields.append(f'"reasoning_content":{encode_basestring(delta.reasoning)}')
        text = sent.content(delta)
        if text or not delta.tool_calls:
            fields.append(f'"content":{encode_basestring(text)}')
        if delta.tool_calls:
            fields.append(f'"tool_calls":{dumps(_calls(delta.tool_calls, sent.calls))}')
        lps = dumps(_logprobs(delta.logprobs)) if delta.logprobs else "null"
        return f'{{"index":{index},"delta":{{{",".join(fields)}}},"logprobs":{lps},"finish_reason":null}}'

    def _last(self, index: int, reason: str, sent: _Sent) -> str:
        # Whitespace still held: content after all, unless the choice made calls.
        held = f'"content":{encode_basestring(sent.held)}' if sent.held and not sent.calls else ""
        return f'{{"index":{index},"delta":{{{held}}},"logprobs":null,"finish_reason":"{reason}"}}'


class CompletionDialect(_OpenAI):
    """``POST /v1/completions``."""

    name = "completions"
    object_prefix = "cmpl-"
    chunk_object = "text_completion"

    def parse(self, body: bytes, config: GatewayConfig) -> Ask:
        req: CompletionRequest = _parse(CompletionRequest, body)
        extra = {"logprobs": req.logprobs} if req.logprobs is not None else {}
        return _job(req, config, req.max_tokens, prompt=_prompt(req.prompt), **extra)

    def response(self, ask: Ask, jobs: Choices, texts: list[str]) -> dict[str, Any]:
        choices = []
        for i, (job, text) in enumerate(zip(jobs.jobs, texts)):
            assert job.done is not None
            logprobs = _text_logprobs(job.logprobs, 0) if ask.request.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish(job.done.finish_reason)})
        return {"id": f"cmpl-{jobs.rid}", "object": "text_completion", "created": int(time.time()),
                "model": ask.request.model, "system_fingerprint": None, "choices": choices, "usage": _usage(jobs)}

    def _text(self, index: int, delta: Delta, sent: _Sent) -> str:
        lps = dumps(_text_logprobs(delta.logprobs, sent.offset)) if delta.logprobs else "null"
        return f'{{"index":{index},"text":{encode_basestring(delta.text)},"logprobs":{lps},"finish_reason":null}}'

    def _last(self, index: int, reason: str, sent: _Sent) -> str:
        return f'{{"index":{index},"text":"","logprobs":null,"finish_reason":"{reason}"}}'


CHAT = ChatDialect()
COMPLETIONS = CompletionDialect()
