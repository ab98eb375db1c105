"""Constrained decoding with llguidance: the one file that imports it.

A request's format (a JSON schema, any JSON object, a regex, a Lark grammar) is compiled once per model into
a matcher template (:meth:`Grammars.compile`, off the MLX thread, cached by its source); each row gets a copy
(:class:`RowMask`). Every step, the batch (``engine/mlx/generation.py``) advances each constrained row's matcher by
the token the row is fed, fills all their token masks at once into one bitmask (llguidance's Rust threads,
without the GIL, while MLX computes the logits) and applies it to the whole batch's logits in one operation.
A complete grammar allows only an end-of-sequence token, so a constrained row ends as any other does.
A JSON schema (a response format's, a tool's parameters) is closed first (:func:`closed_schema`): an object that
names its keys gets no others unless the schema asks for them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

__all__ = ["FormatKind", "Grammar", "GrammarError", "Grammars", "ResponseFormat", "RowMask", "apply_bitmask",
           "closed_schema", "fill_masks", "tool_call_grammar", "vocab_size"]

MAX_SOURCE_CHARS = 64 << 10  # a schema, regex or grammar larger than this is refused
_CACHED = 128  # compiled grammars kept per model
# Compact JSON: no whitespace between tokens, so output under a bounded schema has a bounded length.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


class FormatKind(str, Enum):
    """What a request's output must match."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"  # a Lark grammar (llguidance's dialect, which may embed JSON schemas)


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A request's output format, as the engine takes it: ``source`` is the schema's JSON text, the regex or
    the grammar (empty for ``JSON_OBJECT``)."""

    kind: FormatKind
    source: str = ""


class GrammarError(ValueError):
    """A format that cannot be compiled (the message says why): the request is refused as sent."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled format: copies of its matcher template constrain rows."""

    format: ResponseFormat
    template: llguidance.LLMatcher

    def row(self) -> RowMask:
        """The mask of one row, at the start of its output."""
        return RowMask(self.template.deep_copy())


class RowMask:
    """One row's matcher, in mlx-lm's logits-processor form. The batch recognises it and masks every
    constrained row at once (:func:`fill_masks`); called as a processor, it masks its own row alone."""

    __slots__ = ("fresh", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.fresh = True  # the row's next input is the last token of what it was inserted with: not consumed

    @property
    def error(self) -> str:
        """Why the matcher cannot go on ("" while it can): a token it refused (llguidance may allow an added
        token by its text in a mask and then refuse it as special)."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else ""

    def feed(self, token: int) -> None:
        """The row is fed ``token`` (it was sampled under this mask), unless it is the row's first input."""
        if self.fresh:
            self.fresh = False
        else:
            self.matcher.consume_token(token)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        fed = int(tokens[-1].item())  # type: ignore[arg-type]  # an integer array
        return apply_bitmask(logits, fill_masks([(0, self)], [fed], 1, logits.shape[-1]))


class Grammars:
    """One model's compiler of formats: its llguidance tokenizer, and the grammars compiled so far (LRU).
    Thread-safe: compile on any thread; a compile of a large schema runs without the GIL."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids) or None)
        self._cache: OrderedDict[ResponseFormat, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compiles (cache misses)

    def cached(self, fmt: ResponseFormat) -> Grammar | None:
        """The grammar of ``fmt`` if it was compiled before (and is still cached)."""
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.move_to_end(fmt)
            return hit

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The grammar of ``fmt``, compiled or from the cache; :class:`GrammarError` if it cannot be."""
        hit = self.cached(fmt)
        if hit is not None:
            return hit
        grammar = Grammar(fmt, self._matcher(fmt))
        with self._lock:
            self.compiled += 1
            self._cache[fmt] = grammar
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        return grammar

    def _matcher(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        if len(fmt.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"the {fmt.kind.value} is {len(fmt.source)} characters; at most {MAX_SOURCE_CHARS}")
        text = _grammar_text(fmt)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {fmt.kind.value} does not compile: {_first_line(matcher.get_error())}")
        return matcher


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The width of the model's logits (its config's vocabulary, which may exceed the tokenizer's)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None) if args is not None else None
    return int(size) if size else len(tokenizer.vocab)


def _grammar_text(fmt: ResponseFormat) -> str:
    try:
        if fmt.kind is FormatKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if fmt.kind is FormatKind.JSON_SCHEMA:
            schema = json.loads(fmt.source)
            if not isinstance(schema, dict):
                raise GrammarError("the JSON schema is not a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(closed_schema(schema), defaults=_JSON_OPTIONS)
        if fmt.kind is FormatKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(fmt.source)
        return llguidance.LLMatcher.grammar_from_lark(fmt.source)
    except ValueError as exc:  # json.JSONDecodeError included
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(f"the {fmt.kind.value} is not valid: {_first_line(str(exc))}") from exc


# JSON Schema keywords whose values are schemas (or lists / maps of them); data keywords (const, enum, default,
# examples) are never walked. The "composing" ones constrain the same object as the schema that holds them.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "unevaluatedItems",
        "unevaluatedProperties", "contentSchema")
_ONE_COMPOSING = ("not", "if", "then", "else")
_LIST = ("prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_MAP_COMPOSING = ("dependentSchemas", "dependencies")
# What brings an object's keys from elsewhere: closing such an object (or one of its parts) would refuse them.
_KEYS_FROM_ELSEWHERE = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref", "if",
                        "dependentSchemas", "dependencies")


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that names its keys (``properties`` or
    ``patternProperties``) and leaves ``additionalProperties`` unspecified gets ``"additionalProperties": false``,
    as xgrammar and outlines generate: without it a model may open keys the schema never named and write one until
    ``max_tokens``. An explicit ``additionalProperties`` (``true`` or a schema) is kept, and so is an object whose
    keys also come from elsewhere (``allOf``, a ``$ref`` beside its properties, a ``required`` key it does not
    name, ...) with the parts it is combined with, since closing one part would refuse the others' keys."""
    if not isinstance(schema, dict):
        return schema
    kept: set[str] = set()
    try:
        _close(schema, "#", composing=False, kept=kept, build=False)  # first: the $ref targets that compose
        return _close(schema, "#", composing=False, kept=kept, build=True)
    except RecursionError:  # nested deeper than Python recurses: left as sent, for llguidance to take or refuse
        return schema


def _close(node: Any, pointer: str, *, composing: bool, kept: set[str], build: bool) -> Any:
    """``node`` (at JSON pointer ``pointer``) with its objects closed (``build``), or, without ``build``, the
    pointers of the $ref targets that compose with another schema added to ``kept``."""
    if not isinstance(node, dict):
        return node
    names_keys = "properties" in node or "patternProperties" in node
    if (composing or names_keys) and isinstance(node.get("$ref"), str):
        kept.add(node["$ref"])  # its target is one part of an object: closed, it would refuse the other parts' keys
    out = dict(node) if build else node

    def walk(value: Any, at: str, parts: bool) -> Any:
        return _close(value, at, composing=parts, kept=kept, build=build)

    for key in (*_ONE, *_ONE_COMPOSING):
        if isinstance(node.get(key), dict):
            out[key] = walk(node[key], f"{pointer}/{key}", key in _ONE_COMPOSING)
    for key in ("allOf", "anyOf", "oneOf", *_LIST):
        if isinstance(node.get(key), list):
            # allOf's parts make one object; so do anyOf's / oneOf's beside properties (a list of items does not)
            parts = key in ("allOf", "anyOf", "oneOf") and (names_keys or (key == "allOf" and len(node[key]) > 1))
            out[key] = [walk(v, f"{pointer}/{key}/{i}", parts) for i, v in enumerate(node[key])]
    for key in (*_MAP, *_MAP_COMPOSING):
        if isinstance(node.get(key), dict):
            out[key] = {name: walk(v, f"{pointer}/{key}/{_escape(name)}", key in _MAP_COMPOSING)
                        for name, v in node[key].items()}
    named: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
    required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
    if (build and names_keys and not composing and pointer not in kept
            and not any(key in node for key in _KEYS_FROM_ELSEWHERE) and all(r in named for r in required)):
        out["additionalProperties"] = False
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def fill_masks(rows: list[tuple[int, RowMask]], fed: list[int], batch: int, vocab: int) -> np.ndarray:
    """The bitmask of a batch of ``batch`` rows: each constrained row (index, mask) first advanced by the token
    it is fed now (``fed``), every other row unmasked."""
    for i, mask in rows:
        mask.feed(fed[i])
    bitmask = allocate_token_bitmask(batch, vocab)
    fill_next_token_bitmask_par(_executor(), [(m.matcher, i) for i, m in rows], bitmask)
    return bitmask


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` (rows x vocab) with every token a row's bitmask forbids set to -inf, in one operation."""
    bits = (mx.array(bitmask)[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(bits.shape[0], -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


MAX_PARALLEL_CALLS = 4  # calls in one constrained answer with parallel calls allowed


def tool_call_grammar(tools: Iterable[tuple[str, dict[str, Any]]], start: str, end: str, *, parallel: bool) -> str:
    """A Lark grammar of one tool call (or up to :data:`MAX_PARALLEL_CALLS` with ``parallel``) of ``tools`` (name,
    parameters' JSON schema) in the JSON format mlx-lm's ``json_tools`` parser reads: each call
    ``{"name": ..., "arguments": {...}}`` on a line of its own between the markers ``start`` and ``end`` (Lark
    items: a quoted string, or ``<[id]>`` for a marker that is one token). Each tool's arguments are a JSON
    document of their own, so the ``$ref`` s of its parameters (``#/$defs/...``) resolve in them."""
    rules = []
    for i, (name, params) in enumerate(tools):
        head = json.dumps({"name": name, "arguments": 0}, separators=(",", ":"))[:-2]  # {"name":"f","arguments":
        schema = {**closed_schema(params), "x-guidance": _JSON_OPTIONS}
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} \"}}\"\n"
                     f"args_{i}: %json {json.dumps(schema)}\n")
    repeat = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: {start} "\\n" body "\\n" {end}\n'
            f"body: {' | '.join(f'call_{i}' for i in range(len(rules)))}\n" + "".join(rules))
