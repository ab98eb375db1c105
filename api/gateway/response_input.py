"""A Responses API request (``POST /v1/responses``) as the chat completions request it amounts to.

The job is made by the chat path itself (``openai_api.CHAT.parse``): a response's input items become chat
messages, its flat function tools chat's nested ones, ``text.format`` a ``response_format``,
``max_output_tokens`` ``max_completion_tokens``; so a response runs the very job the same chat request would.

Input items: messages (user, assistant, system, developer; a string, or ``input_text`` / ``output_text`` /
``input_image`` parts), ``function_call`` (a call the model made) and ``function_call_output`` (its result),
and ``reasoning`` items (accepted and left out of the prompt, as chat leaves out ``reasoning_content``).
Anything else is a 400 that names it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import GatewayConfig
from .dialect import Ask
from .errors import GatewayError, invalid, validation_problem
from .openai_api import CHAT

__all__ = ["ResponsesRequest", "chat_body", "input_items", "parse_request", "to_ask"]

MAX_METADATA = 16  # OpenAI's bound on metadata pairs


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: str | None = None  # accepted and without effect


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # summary, generate_summary, context, mode: nothing to map

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are refused (as OpenAI does), so none is silently lost."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # no logprobs here (chat has them)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    user: str | None = None
    # Accepted and without effect here.
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the start of a long input) is not done
    # The queue's extensions, as chat takes them.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None


def parse_request(body: bytes) -> ResponsesRequest:
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        raise GatewayError(validation_problem(exc)) from None
    if req.background and not req.store:
        raise invalid("background responses must be stored: store false cannot go with background true",
                      "invalid_request_error")
    return req


def input_items(req: ResponsesRequest, response_id: str) -> list[dict[str, Any]]:
    """The request's input as items, each with an id (what ``input_items`` lists and a later turn replays)."""
    raw = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    out = []
    stem = response_id.removeprefix("resp_")
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind not in ("message", "function_call", "function_call_output", "reasoning"):
            raise invalid(f"input[{i}]: items of type {kind!r} are not supported (messages, function_call, "
                          "function_call_output and reasoning are)", "unsupported_parameter")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
        one = {**item, "type": kind, "id": item.get("id") or f"{prefix}_in_{stem}_{i}"}
        if kind == "message" and isinstance(one.get("content"), str):  # listed as parts, as OpenAI lists them
            one["content"] = [_text_part(one.get("role"), one["content"])]
        out.append(one)
    return out


def _text_part(role: Any, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def to_ask(req: ResponsesRequest, context: list[dict[str, Any]], items: list[dict[str, Any]],
           config: GatewayConfig, cache_key: str | None) -> Ask:
    """The job: ``context`` (the previous responses' items), then this request's ``items``, as chat would run
    them; ``cache_key``: the affinity key when the request names none."""
    return CHAT.parse(chat_body(req, context + items, cache_key), config)  # validated as chat's, not re-read


def chat_body(req: ResponsesRequest, items: list[dict[str, Any]], cache_key: str | None) -> dict[str, Any]:
    """The chat completions request the response amounts to."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(items)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name in ("temperature", "top_p", "metadata", "user", "seed", "top_k", "min_p", "repetition_penalty",
                 "priority", "parallel_tool_calls"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.prompt_cache_key is not None or cache_key is not None:
        body["prompt_cache_key"] = req.prompt_cache_key or cache_key
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text else None
    if fmt is not None:
        body["response_format"] = _format(fmt)
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise invalid(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function tools are)",
                      "unsupported_parameter")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported (none, auto, required or "
                  "a function)", "unsupported_parameter")


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind in ("regex", "grammar"):  # the queue's own formats, as chat's response_format takes them
        return fmt
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid(f"text.format of type {kind!r} is not supported (text, json_object, json_schema; the queue's "
                  "regex and grammar)",
                  "unsupported_parameter")


# --- items -> chat messages ---------------------------------------------------------------------------
def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name (a tool turn names its function)
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            names[str(item.get("call_id"))] = str(item.get("name"))
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "name": names.get(str(call_id)),
                        "content": _content(item.get("output"), i)})
        # reasoning items: the thinking of an earlier turn, which the prompt leaves out (as chat does)
    return out


def _content(content: Any, i: int) -> Any:
    """A message's content as chat parts (the chat path checks them further); text alone as one string, as the
    chat path makes it of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"input[{i}].content: a string or a list of parts")
    parts = [_part(p, f"input[{i}].content[{j}]") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text", "refusal"):
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}: a {kind} part needs a string")
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise invalid(f"{where}: an input_image part needs an image_url (file_id is not supported)",
                          "unsupported_content")
        return {"type": "image_url", "image_url": {"url": url}}
    raise invalid(f"{where}: content parts of type {kind!r} are not supported (input_text, output_text and "
                  "input_image are)", "unsupported_content")
