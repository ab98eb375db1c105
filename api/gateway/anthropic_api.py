"""Anthropic's Messages API over the queue: ``/v1/messages``, requests in and responses out.

Mapped: ``system``, ``messages`` (text and image blocks, ``tool_use`` and ``tool_result`` blocks), the sampling
fields, ``stop_sequences``, ``metadata.user_id``, ``stream``, ``thinking`` (the chat template's
enable_thinking: a thinking block before the text; ``budget_tokens`` is not enforced) and client ``tools`` with
``tool_choice``: the model's calls come as ``tool_use`` blocks after its text, ``stop_reason`` ``tool_use``.
Refused with a 400 that names them: server tools, documents and a final assistant turn (a prefill).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..schema import ChatMessage, DoneEvent, FinishReason, FunctionCall, GenerateRequest, ToolCall
from .config import GatewayConfig
from .content import chat_content
from .dialect import Ask, dumps, sse
from .errors import GatewayError, Kind, Problem, invalid, validation_problem
from .job import Choices, JobStream
from .sse import Last

__all__ = ["MESSAGES", "MessagesDialect", "anthropic_error"]

_ERROR_TYPES = {Kind.INVALID: "invalid_request_error", Kind.UNAUTHORIZED: "authentication_error",
                Kind.NOT_FOUND: "not_found_error", Kind.TOO_LARGE: "request_too_large",
                Kind.RATE_LIMITED: "rate_limit_error", Kind.UPSTREAM: "api_error",
                Kind.UNAVAILABLE: "overloaded_error"}
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Any]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages``. Unknown fields are refused (as Anthropic does), so none is silently lost."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Accepted, without effect here: prompt caching, routing and account hints.
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def _refusals(body: MessagesRequest) -> list[str]:
    out = []
    server = sorted({str(t.get("type")) for t in body.tools or [] if isinstance(t, dict)} - {"custom", "None"})
    if server:
        out.append(f"server tools ({', '.join(server)})")
    if body.thinking and body.thinking.get("type") not in ("enabled", "disabled"):
        out.append(f"thinking of type {body.thinking.get('type')!r}")
    if body.messages[-1].role == "assistant":
        out.append("a final assistant turn (prefill)")
    return out


def _messages(body: MessagesRequest) -> list[ChatMessage]:
    out = []
    system = chat_content(body.system, "system")
    if system:
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(body.messages):
        out.extend(_turn(m, f"messages[{i}]"))
    return out


def _turn(m: MessageIn, where: str) -> list[ChatMessage]:
    """One Anthropic turn as chat messages: a user turn's tool results (each a tool turn) before its text; an
    assistant turn's text with its tool calls (its thinking blocks are not shown to the model again)."""
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    blocks = [b for b in m.content if not (isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking"))]
    uses = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
    rest = [b for b in blocks if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result"))]
    if (uses and m.role != "assistant") or (results and m.role != "user"):
        raise invalid(f"{where}: tool_use blocks belong in assistant turns, tool_result blocks in user turns")
    out = [ChatMessage(role="tool", tool_call_id=_text_field(b, "tool_use_id", where),
                       content=chat_content(_result_text(b.get("content"), where), where)) for b in results]
    content = chat_content(rest, where)
    if uses:
        calls = [ToolCall(id=_text_field(b, "id", where), function=FunctionCall(
            name=_text_field(b, "name", where), arguments=json.dumps(b.get("input") or {}))) for b in uses]
        out.append(ChatMessage(role="assistant", content=content, tool_calls=calls))
    elif rest or not results:
        out.append(ChatMessage(role=m.role, content=content))
    return out


def _result_text(content: Any, where: str) -> str | list[Any] | None:
    """A tool result's content: a string, or text blocks (images in a tool result are not supported)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return content
    raise invalid(f"{where}: a tool_result's content is a string or text blocks", "unsupported_content")


def _text_field(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}: a {block.get('type')} block needs a string {name!r}")
    return value


def _tools(body: MessagesRequest) -> dict[str, Any]:
    """The job's tool fields: Anthropic's tools (name, description, input_schema) and tool_choice, as OpenAI's."""
    if not body.tools:
        if body.tool_choice and body.tool_choice.get("type") in ("any", "tool"):
            raise invalid("tool_choice requires tools")
        return {}
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t.get("name")),
             ("description", t.get("description")), ("parameters", t.get("input_schema"))) if v is not None}}
             for t in body.tools if isinstance(t, dict)]
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    fields: dict[str, Any] = {"tools": tools}
    if kind == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind in ("auto", "any", "none"):
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise invalid(f"tool_choice of type {kind!r} (expected auto, any, tool or none)")
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    return fields


def _stop(done: DoneEvent) -> dict[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a job's end."""
    if done.finish_reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if done.finish_reason is FinishReason.TOOL_CALLS:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if done.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": done.stop_sequence}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def anthropic_error(problem: Problem) -> dict[str, Any]:
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}`` (and mlxq's ``code``)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES[problem.kind], "message": problem.message,
                                       "code": problem.code}}


class MessagesDialect:
    """``POST /v1/messages``."""

    name = "messages"

    def parse(self, body: bytes, config: GatewayConfig) -> Ask:
        try:
            req = MessagesRequest.model_validate_json(body)
        except ValidationError as exc:
            raise GatewayError(validation_problem(exc)) from None
        refused = _refusals(req)
        if refused:
            raise invalid(f"not supported by this server: {', '.join(refused)}", "unsupported_parameter")
        sampling = {k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(req, k)) is not None}
        metadata = {"user_id": req.metadata.user_id} if req.metadata and req.metadata.user_id else {}
        thinking = req.thinking.get("type") == "enabled" if req.thinking else None
        try:
            # A reasoning model's thinking goes out as thinking blocks, apart from the text.
            job = GenerateRequest(model=req.model, messages=_messages(req), max_tokens=req.max_tokens,
                                  stop=[s for s in req.stop_sequences or [] if s], metadata=metadata,
                                  reasoning="split", enable_thinking=thinking, **sampling, **_tools(req))
        except ValidationError as exc:
            raise GatewayError(validation_problem(exc)) from None
        return Ask(job, req.stream)

    def response(self, ask: Ask, jobs: Choices, texts: list[str]) -> dict[str, Any]:
        job, text = jobs.first, texts[0]
        assert job.done is not None
        usage = job.done.usage
        content = [{"type": "thinking", "thinking": job.reasoning, "signature": ""}] if job.reasoning else []
        if text.strip() or not job.tool_calls:  # whitespace around calls is no text block
            content.append({"type": "text", "text": text})
        content.extend(_tool_use(call) for call in job.tool_calls)
        return {**self._message(ask, job), "content": content, **_stop(job.done),
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}}

    def _message(self, ask: Ask, job: JobStream) -> dict[str, Any]:
        return {"id": f"msg_{job.rid}", "type": "message", "role": "assistant", "model": ask.request.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0}}

    async def frames(self, ask: Ask, jobs: Choices) -> AsyncIterator[bytes]:
        job = jobs.first
        # Events that go out together are joined into one write (one send each, as in the OpenAI dialect).
        yield (_event("message_start", {"type": "message_start", "message": self._message(ask, job)})
               + _event("ping", {"type": "ping"}))
        blocks = _Blocks()
        async for delta in job.deltas():
            out = blocks.add("thinking", delta.reasoning) if delta.reasoning else b""
            spoken = delta.text.strip() or not delta.tool_calls  # whitespace beside calls is no text
            out += blocks.add("text", delta.text) if delta.text and spoken else b""
            yield out + blocks.calls(delta.tool_calls)
        assert job.done is not None
        usage = {"output_tokens": job.done.usage.completion_tokens}
        text = blocks.add("text", "") if not blocks.called else b""  # a message has a text block or calls
        yield Last(text + blocks.close()
                   + _event("message_delta", {"type": "message_delta", "delta": _stop(job.done), "usage": usage})
                   + _event("message_stop", {"type": "message_stop"}))

    def error_body(self, problem: Problem) -> dict[str, Any]:
        return anthropic_error(problem)

    def error_frame(self, problem: Problem) -> bytes:
        return Last(_event("error", anthropic_error(problem)))


class _Blocks:
    """A streamed message's content blocks: a thinking block (a reasoning model's), then the text block."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.called = False

    def calls(self, calls: Sequence[ToolCall]) -> bytes:
        """A tool_use block per call: opened with the call's id and name, its input as one JSON delta."""
        out = b""
        for call in calls:
            self.called = True
            out += self._open("tool_use", {**_tool_use(call), "input": {}})
            out += _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call.function.arguments}})
        return out

    def add(self, kind: str, text: str) -> bytes:
        """``text`` as a delta of a block of ``kind``, opening it (and closing the one before) when it is new."""
        out = b""
        if kind != self.kind:
            out = self._open(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                             else {"type": "text", "text": ""})
        if not text:
            return out
        delta_type, field = _DELTAS[kind]
        return out + (f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{self.index},'
                      f'"delta":{{"type":"{delta_type}","{field}":{encode_basestring(text)}}}}}\n\n').encode()

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        """A new block (the one open before closed)."""
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})

    def close(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.index})


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": json.loads(call.function.arguments)}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return sse(dumps(data), name)


MESSAGES = MessagesDialect()
