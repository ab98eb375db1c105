"""OpenAI's API over the queue: ``/v1/chat/completions`` and ``/v1/completions``, requests in and responses out.

Mapped: ``model``, ``messages`` (``developer`` is a system turn; text content parts are joined) or ``prompt``,
``max_completion_tokens``/``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``,
``frequency_penalty``, ``metadata``, ``stream`` and ``stream_options.include_usage``; mlx-lm's and vLLM's
extensions ``top_k``, ``min_p``, ``repetition_penalty`` and mlxq's ``priority``; ``response_format``
(``json_object``, ``json_schema``, and mlxq's ``regex`` and ``grammar``: the output is constrained to it); a
reasoning model's thinking goes out as ``reasoning_content`` (``chat_template_kwargs.enable_thinking`` switches
it, as vLLM takes it).
``image_url`` content parts become the job's image parts (a model that takes no images refuses them: a 400 from
its worker); chat's ``logprobs`` and ``top_logprobs`` (each token's text, log-probability and bytes). Refused
with a 400 that names them: ``n`` other than 1, the completions API's ``logprobs``, tools and functions,
``logit_bias``, audio, ``echo``, ``suffix``, ``best_of`` > 1 and token-id prompts. ``user`` goes into the job's
metadata.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..schema import ChatMessage, FinishReason, GenerateRequest, TokenLogprob
from .config import GatewayConfig
from .content import chat_content
from .dialect import Ask, dumps, sse
from .errors import GatewayError, Kind, Problem, invalid, validation_problem
from .job import JobStream
from .sse import Last

__all__ = ["CHAT", "COMPLETIONS", "ChatDialect", "CompletionDialect", "openai_error"]

_DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {Kind.INVALID: "invalid_request_error", Kind.UNAUTHORIZED: "authentication_error",
                Kind.NOT_FOUND: "invalid_request_error", Kind.TOO_LARGE: "invalid_request_error",
                Kind.RATE_LIMITED: "rate_limit_error", Kind.UPSTREAM: "server_error",
                Kind.UNAVAILABLE: "service_unavailable_error"}
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
    n: int | None = None
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
    # Accepted and without effect here.
    service_tier: str | None = None
    store: bool | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, audio: nothing to map them to

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None
    tool_calls: list[Any] | None = None


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
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def _refusals(body: _Common) -> list[str]:
    """What the request asks for that the gateway does not do."""
    out = []
    if body.n not in (None, 1):
        out.append("n other than 1 (one choice per request)")
    if body.logit_bias:
        out.append("logit_bias")
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            out.append("top_logprobs without logprobs: true")
        if body.tools or body.functions or body.tool_choice not in (None, "none") or body.function_call:
            out.append("tools and function calling")
        if (body.modalities and set(body.modalities) != {"text"}) or body.audio:
            out.append("audio output")
        if body.prediction:
            out.append("prediction")
        unknown = sorted(set(body.chat_template_kwargs or {}) - {"enable_thinking"})
        if unknown:
            out.append(f"chat_template_kwargs {', '.join(unknown)} (only enable_thinking)")
    if isinstance(body, CompletionRequest):
        if body.logprobs:
            out.append("logprobs")
        if body.echo:
            out.append("echo")
        if body.suffix:
            out.append("suffix")
        if body.best_of not in (None, 1):
            out.append("best_of > 1")
    return out


def _parse(model: type[_Common], body: bytes) -> Any:
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise GatewayError(validation_problem(exc)) from None
    refused = _refusals(parsed)
    if refused:
        raise invalid(f"not supported by this server: {', '.join(refused)}", "unsupported_parameter")
    return parsed


def _job(body: _Common, config: GatewayConfig, max_tokens: int | None, **prompt: Any) -> Ask:
    """The job: the prompt given, the sampling fields set, the default ``max_tokens`` when none is."""
    fields: dict[str, Any] = {name: v for name in _SAMPLING if (v := getattr(body, name)) is not None}
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    metadata = dict(body.metadata or {})
    if body.user:
        metadata.setdefault("user", body.user)
    try:
        req = GenerateRequest(model=body.model, max_tokens=max_tokens or config.default_max_tokens,
                              stop=[s for s in stops if s], metadata=metadata, **fields, **prompt)
    except ValidationError as exc:
        raise GatewayError(validation_problem(exc)) from None
    usage = body.stream_options is not None and body.stream_options.include_usage
    return Ask(req, body.stream, usage)


def _messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "function" or m.tool_calls:
            raise invalid(f"{where}: function and tool calls are not supported", "unsupported_parameter")
        role = "system" if m.role == "developer" else m.role
        out.append(ChatMessage(role=role, content=chat_content(m.content, where)))
    return out


def _prompt(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise invalid("prompt: one string per request (no batches, no token ids)", "unsupported_parameter")


# --- responses -------------------------------------------------------------------------------------
def _finish(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def _usage(job: JobStream) -> dict[str, int]:
    assert job.done is not None
    u = job.done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A choice's ``logprobs``: each token's text, log-probability, UTF-8 bytes and its top alternatives."""
    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(lp.text, lp.logprob), "top_logprobs": [one(t.text, t.logprob) for t in lp.top]}
                        for lp in entries], "refusal": None}


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

    def _head(self, ask: Ask, job: JobStream, created: int) -> str:
        """A chunk's JSON up to its ``choices`` (and after them, ``usage: null`` when usage comes last)."""
        return (f'{{"id":"{self.object_prefix}{job.rid}","object":"{self.chunk_object}","created":{created},'
                f'"model":{encode_basestring(ask.request.model)},"system_fingerprint":null,"choices":')

    def _tail(self, ask: Ask) -> str:
        return ',"usage":null}' if ask.include_usage else "}"

    def _start(self) -> str | None:
        return None

    def _text(self, text: str, reasoning: str = "", logprobs: tuple[TokenLogprob, ...] = ()) -> str:
        raise NotImplementedError

    def _last(self, reason: str) -> str:
        raise NotImplementedError

    async def frames(self, ask: Ask, job: JobStream) -> AsyncIterator[bytes]:
        # Frames that go out together are joined into one write: each write is a send (a system call, and a
        # wake-up of the reader) and a pass through the HTTP stack.
        created = int(time.time())
        head, tail = self._head(ask, job, created), self._tail(ask)
        start = self._start()
        opening = f"data: {head}{start}{tail}\n\n" if start is not None else ""  # goes with the first text
        async for delta in job.deltas():
            yield f"{opening}data: {head}{self._text(delta.text, delta.reasoning, delta.logprobs)}{tail}\n\n".encode()
            opening = ""
        assert job.done is not None
        closing = [opening, f"data: {head}{self._last(_finish(job.done.finish_reason))}{tail}\n\n"]
        if ask.include_usage:
            closing.append(f'data: {head}[],"usage":{dumps(_usage(job))}}}\n\n')
        yield Last("".join(closing).encode() + _DONE)


class ChatDialect(_OpenAI):
    """``POST /v1/chat/completions``."""

    name = "chat"
    object_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def parse(self, body: bytes, config: GatewayConfig) -> Ask:
        req: ChatRequest = _parse(ChatRequest, body)
        fmt = req.response_format
        extra: dict[str, Any] = {"response_format": fmt} if fmt and fmt.get("type") != "text" else {}
        extra["reasoning"] = "split"  # a reasoning model's thinking goes out as reasoning_content
        thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is not None:
            extra["enable_thinking"] = thinking
        if req.logprobs:
            extra["logprobs"] = req.top_logprobs or 0
        return _job(req, config, req.max_completion_tokens or req.max_tokens, messages=_messages(req.messages),
                    **extra)

    def response(self, ask: Ask, job: JobStream, text: str) -> dict[str, Any]:
        assert job.done is not None
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if job.reasoning:
            message["reasoning_content"] = job.reasoning
        logprobs = _logprobs(job.logprobs) if ask.request.logprobs is not None else None
        choice = {"index": 0, "message": message, "logprobs": logprobs,
                  "finish_reason": _finish(job.done.finish_reason)}
        return {"id": f"chatcmpl-{job.rid}", "object": "chat.completion", "created": int(time.time()),
                "model": ask.request.model, "system_fingerprint": None, "choices": [choice], "usage": _usage(job)}

    def _start(self) -> str:
        return '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'

    def _text(self, text: str, reasoning: str = "", logprobs: tuple[TokenLogprob, ...] = ()) -> str:
        if reasoning:  # vLLM's and DeepSeek's field for a reasoning model's thinking
            delta = f'"reasoning_content":{encode_basestring(reasoning)},"content":{encode_basestring(text)}'
        else:
            delta = f'"content":{encode_basestring(text)}'
        lps = dumps(_logprobs(logprobs)) if logprobs else "null"
        return f'[{{"index":0,"delta":{{{delta}}},"logprobs":{lps},"finish_reason":null}}]'

    def _last(self, reason: str) -> str:
        return f'[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{reason}"}}]'


class CompletionDialect(_OpenAI):
    """``POST /v1/completions``."""

    name = "completions"
    object_prefix = "cmpl-"
    chunk_object = "text_completion"

    def parse(self, body: bytes, config: GatewayConfig) -> Ask:
        req: CompletionRequest = _parse(CompletionRequest, body)
        return _job(req, config, req.max_tokens, prompt=_prompt(req.prompt))

    def response(self, ask: Ask, job: JobStream, text: str) -> dict[str, Any]:
        assert job.done is not None
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(job.done.finish_reason)}
        return {"id": f"cmpl-{job.rid}", "object": "text_completion", "created": int(time.time()),
                "model": ask.request.model, "system_fingerprint": None, "choices": [choice], "usage": _usage(job)}

    def _text(self, text: str, reasoning: str = "", logprobs: tuple[TokenLogprob, ...] = ()) -> str:
        return f'[{{"index":0,"text":{encode_basestring(text)},"logprobs":null,"finish_reason":null}}]'

    def _last(self, reason: str) -> str:
        return f'[{{"index":0,"text":"","logprobs":null,"finish_reason":"{reason}"}}]'


CHAT = ChatDialect()
COMPLETIONS = CompletionDialect()
