"""A job's tools, and the format its output must match: the model's call markers the engine splits its calls out
by (``engine/core/parts.py``); the text of each call, parsed with the model's own mlx-lm tool parser
(``mlx_lm/tool_parsers``, chosen by mlx-lm's tokenizer wrapper for the model family) into the wire's
:class:`~api.schema.ToolCall` records; and the format the engine constrains the output to: the request's
``response_format``, else the grammar of calls of its tools (``tool_choice`` required or named).

A call that does not parse (a model that wrote a malformed call under ``auto``) is not lost: its text, markers
included, goes back into the answer's text, as a model without tools would have said it. One cut off by
``max_tokens`` never comes here: under ``auto`` the engine leaves it in the answer's text as the model wrote it (no
end marker); where the request requires a call (``required`` or named) it drops it, so the answer ends ``length``
with neither a call nor its markup.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxq.api.schema import (
    FunctionCall,
    GenerateRequest,
    GrammarFormat,
    JSONObjectFormat,
    JSONSchemaFormat,
    NamedToolChoice,
    RegexFormat,
    ToolCall,
)
from mlxq.engine.mlx.constrain import FormatKind, ResponseFormat, tool_call_grammar

if TYPE_CHECKING:
    from .prompt import Prompt

__all__ = ["CallGrammarError", "ToolCalls", "Tools", "call_grammar", "tools_of"]

log = logging.getLogger(__name__)

Parser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools): a dict {name, arguments} or a list
_CONSTRAINABLE = "json_tools"  # the tool-call formats whose calls a grammar can constrain (one, for now)


class CallGrammarError(ValueError):
    """The job's tool_choice needs a constrained call this model's tool-call format cannot give."""


@dataclass(slots=True)
class ToolCalls:
    """One run's tool calls: parsed as the engine completes them, numbered for their ids."""

    rid: str
    parse: Parser
    tools: list[dict[str, Any]]  # as the chat template got them (the parser may read their types)
    markers: tuple[str, str]
    calls: list[ToolCall] = field(default_factory=list)

    def take(self, texts: list[str]) -> tuple[list[ToolCall], str]:
        """The calls in ``texts`` (each one call's text), and the text of those that do not parse."""
        calls: list[ToolCall] = []
        rest: list[str] = []
        for text in texts:
            parsed = self._parse(text)
            if parsed is None:
                rest.append(self.markers[0] + text + self.markers[1])
                continue
            for name, arguments in parsed:
                calls.append(ToolCall(id=f"call_{self.rid}_{len(self.calls) + len(calls)}",
                                      function=FunctionCall(name=name, arguments=arguments)))
        self.calls.extend(calls)
        return calls, "".join(rest)

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        try:
            parsed = self.parse(text, self.tools)
        except Exception as exc:  # a parser's error is the model's text's fault, whatever its type
            log.info("job %s: a tool call did not parse (%s: %s); its text stays in the answer", self.rid,
                     type(exc).__name__, exc)
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        out: list[tuple[str, str]] = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
                log.info("job %s: a tool call without a function name; its text stays in the answer", self.rid)
                return None
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # a parser that leaves them as text: they must be a JSON object
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
            if not isinstance(arguments, dict):
                log.info("job %s: a tool call's arguments are not a JSON object; its text stays in the answer",
                         self.rid)
                return None
            out.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        return out


@dataclass(frozen=True, slots=True)
class Tools:
    """What a job's tools ask of its run: the model's call markers the engine splits calls out by and the parser
    of its calls (None: the request gives no tools, or the model has no tool-call format, so what it writes is all
    answer); and the format its output must match, as the engine compiles it: its response_format, else the
    grammar its tool_choice calls for (None: free text)."""

    markers: tuple[str, str] | None = None
    calls: ToolCalls | None = None
    format: ResponseFormat | None = None


def tools_of(req: GenerateRequest, prompt: Prompt, tokenizer: Any) -> Tools:
    """A job's tools, as its ``prompt``'s chat template was shown them, and its output's format;
    :class:`CallGrammarError` when its tool_choice needs a constrained call the model cannot give (a response
    format, if it has one, comes first)."""
    markers = _markers(req, tokenizer)
    calls = ToolCalls(req.id, tokenizer.tool_parser, prompt.tools, markers) if markers is not None else None
    if req.response_format is not None:
        return Tools(markers, calls, _response_format(req))
    grammar = call_grammar(req, tokenizer)
    return Tools(markers, calls, ResponseFormat(FormatKind.LARK, grammar) if grammar is not None else None)


def _response_format(req: GenerateRequest) -> ResponseFormat | None:
    """What the request's response_format says its output must match, as the engine compiles it; None for free
    text."""
    fmt = req.response_format
    if isinstance(fmt, JSONSchemaFormat):
        return ResponseFormat(FormatKind.JSON_SCHEMA, fmt.schema_text)
    if isinstance(fmt, JSONObjectFormat):
        return ResponseFormat(FormatKind.JSON_OBJECT)
    if isinstance(fmt, RegexFormat):
        return ResponseFormat(FormatKind.REGEX, fmt.regex)
    if isinstance(fmt, GrammarFormat):
        return ResponseFormat(FormatKind.LARK, fmt.grammar)
    return None


def _markers(req: GenerateRequest, tokenizer: Any) -> tuple[str, str] | None:
    """The model's tool-call markers, for a request whose tools it is shown (None: no tools, or no format with
    both markers)."""
    if not req.calls_tools or tokenizer is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return (tokenizer.tool_call_start, tokenizer.tool_call_end) if tokenizer.tool_call_end else None


def call_grammar(req: GenerateRequest, tokenizer: Any) -> str | None:
    """The Lark grammar a job's output is constrained to (None: ``auto``, the model chooses); raises
    :class:`CallGrammarError` for a model whose tool-call format cannot be constrained."""
    choice = req.tool_choice
    if req.tools is None or choice in ("auto", "none"):
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    family = getattr(parser, "__module__", "").rpartition(".")[2]
    if family != _CONSTRAINABLE:
        raise CallGrammarError(f"tool_choice {_describe(choice)} needs calls in the {_CONSTRAINABLE} format; this "
                               f"model's is {family or 'none'} (use tool_choice 'auto')")
    tools = [(t.function.name, t.function.parameters) for t in req.tools
             if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    start = _marker(tokenizer, tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = _marker(tokenizer, tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    return tool_call_grammar(tools, start, end, parallel=req.parallel_tool_calls and choice == "required")


def _marker(tokenizer: Any, text: str, tokens: tuple[int, ...] | None) -> str:
    """A marker as a Lark item: the token itself when it is one (an added token the grammar's text cannot
    spell), else its text."""
    return f"<[{tokens[0]}]>" if tokens is not None and len(tokens) == 1 else json.dumps(text)


def _describe(choice: object) -> str:
    return f"naming {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)

