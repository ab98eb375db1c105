"""Constrained decoding on the real tiny model through the scheduler and mlx-lm's batch: a random-weight model's
greedy output under a format always matches it, constrained and free rows share one batch without changing
each other, and a constrained row preempted, resumed or started at once goes on exactly."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.constrain import (
    FormatKind,
    Grammar,
    GrammarError,
    Grammars,
    ResponseFormat,
    closed_schema,
    vocab_size,
)
from tests.engine.fakes import Run
from tests.engine.real import drive, still

pytestmark = pytest.mark.unit


class Color(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say

    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say

    color: Color
    parts: list[Part] = Field(max_length=2)
    note: str = Field(max_length=6)
    price: int = Field(ge=-5, le=500)
    urgent: bool


class OpenPart(BaseModel):  # no extra="forbid": its schema leaves additionalProperties unspecified
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)


class OpenOrder(BaseModel):
    color: Color
    parts: list[OpenPart] = Field(max_length=2)
    note: str = Field(max_length=6)
    spare: OpenPart | None = None


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


@pytest.fixture(scope="module")
def grammars(lm: Any) -> Grammars:
    model, tokenizer = lm
    return Grammars(tokenizer._tokenizer, vocab_size(model, tokenizer), tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


def schema_format(model: type[BaseModel]) -> ResponseFormat:
    return ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(model.model_json_schema()))


def scheduler(lm: Any, stream: mx.Stream, capacity: int = 8) -> Scheduler:
    model, tokenizer = lm
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=8, prefill_step_size=64,
                     stream=stream)
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer, clock=still)


def request(lm: Any, rid: str, grammar: Grammar | None, max_tokens: int = 160, seed: int = 0,
            priority: int = 0) -> EngineRequest:
    words = ["order", "a", "part", "for", "the", "blue", "queue", "model"]
    text = " ".join(words[(i * 5 + seed) % len(words)] for i in range(6 + seed % 5))
    return EngineRequest(rid, list(lm[1].encode(text)), SamplingParams(max_tokens=max_tokens), priority=priority,
                         format=grammar)



def generate(lm: Any, stream: mx.Stream, reqs: list[EngineRequest], capacity: int = 8) -> Run:
    s, run = scheduler(lm, stream, capacity), Run()
    for r in reqs:
        s.add(r)
    drive(s, run, stream, steps=3000)
    return run


def test_greedy_output_under_a_schema_parses_and_validates(lm: Any, stream: mx.Stream, grammars: Grammars) -> None:
    grammar = grammars.compile(schema_format(Order))
    run = generate(lm, stream, [request(lm, f"r{i}", grammar, seed=i) for i in range(6)])
    for i in range(6):
        assert run.final(f"r{i}").finish is FinishReason.STOP, run.text(f"r{i}")
        Order.model_validate_json(run.text(f"r{i}"))
    again = generate(lm, stream, [request(lm, "r0", grammar, seed=0)])
    assert again.text("r0") == run.text("r0")  # greedy under a schema is deterministic


def test_a_schema_that_leaves_additional_properties_unspecified_gets_only_its_keys(
        lm: Any, stream: mx.Stream, grammars: Grammars) -> None:
    # Unclosed, a random-weight model opens a key the schema never named and writes it until max_tokens.
    schema = OpenOrder.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    grammar = grammars.compile(ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema)))
    run = generate(lm, stream, [request(lm, f"r{i}", grammar, max_tokens=400, seed=i) for i in range(4)])
    for i in range(4):
        assert run.final(f"r{i}").finish is FinishReason.STOP, run.text(f"r{i}")
        doc = json.loads(run.text(f"r{i}"))
        assert set(doc) <= set(OpenOrder.model_fields), doc
        assert all(set(p) <= set(OpenPart.model_fields) for p in doc["parts"] + [doc.get("spare") or {}]), doc


def accepts(grammars: Grammars, schema: dict[str, Any], doc: str) -> bool:
    """Whether the grammar of ``schema`` takes ``doc`` whole."""
    matcher = grammars.compile(ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(schema))).row().matcher
    return bool(matcher.consume_tokens(grammars.tokenizer.tokenize_str(doc))) and matcher.is_accepting()


@pytest.mark.parametrize(("schema", "doc", "taken"), [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1,"b":2}', False),  # unnamed: closed
    ({"properties": {"a": {"properties": {"x": {"type": "integer"}}}}}, '{"a":{"x":1,"y":2}}', False),  # nested too
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     '{"a":1,"b":2}', True),  # the schema asks for other keys: kept
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"a":1,"b":"x"}', True),
    ({"type": "object"}, '{"b":2}', True),  # names no keys: any object, as before
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
     '{"a":1,"b":2}', True),  # parts of one object: each keeps the other's keys
    ({"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "integer"}}}],
      "$defs": {"A": {"properties": {"a": {"type": "integer"}}}}}, '{"a":1,"b":2}', True),
])
def test_only_a_schema_that_asks_for_them_allows_unnamed_keys(grammars: Grammars, schema: dict[str, Any], doc: str,
                                                               taken: bool) -> None:
    before = json.dumps(schema)
    assert accepts(grammars, schema, doc) is taken
    assert json.dumps(schema) == before  # the caller's schema is not changed
    assert json.loads(before) == schema and closed_schema(schema) is not schema


def test_constrained_and_free_rows_share_a_batch_without_changing_each_other(
        lm: Any, stream: mx.Stream, grammars: Grammars) -> None:
    grammar = grammars.compile(ResponseFormat(FormatKind.JSON_OBJECT))
    mixed = [request(lm, f"r{i}", grammar if i % 2 else None, max_tokens=40, seed=i) for i in range(8)]
    run = generate(lm, stream, mixed)
    alone = generate(lm, stream, [request(lm, f"r{i}", None, max_tokens=40, seed=i) for i in range(0, 8, 2)])
    for i in range(8):
        if i % 2:
            if run.final(f"r{i}").finish is FinishReason.STOP:
                assert isinstance(json.loads(run.text(f"r{i}")), dict)
            else:  # cut by max_tokens: a prefix of an object
                assert run.text(f"r{i}").startswith("{")
        else:
            assert run.tokens(f"r{i}") == alone.tokens(f"r{i}")


def test_a_regex_constrains_the_whole_output(lm: Any, stream: mx.Stream, grammars: Grammars) -> None:
    grammar = grammars.compile(ResponseFormat(FormatKind.REGEX, r"(yes|no), [a-z]{2,5}!"))
    run = generate(lm, stream, [request(lm, f"r{i}", grammar, seed=i) for i in range(4)])
    for i in range(4):
        assert re.fullmatch(r"(yes|no), [a-z]{2,5}!", run.text(f"r{i}")), run.text(f"r{i}")


def test_max_tokens_cuts_a_constrained_row_with_length(lm: Any, stream: mx.Stream, grammars: Grammars) -> None:
    grammar = grammars.compile(schema_format(Order))
    run = generate(lm, stream, [request(lm, "r", grammar, max_tokens=5)])
    assert run.final("r").finish is FinishReason.LENGTH and len(run.tokens("r")) == 5


def test_a_constrained_row_preempted_and_resumed_goes_on_exactly(lm: Any, stream: mx.Stream,
                                                                  grammars: Grammars) -> None:
    grammar = grammars.compile(schema_format(Order))
    plain = generate(lm, stream, [request(lm, "low", grammar)], capacity=1)
    s, run = scheduler(lm, stream, capacity=1), Run()
    s.add(request(lm, "low", grammar))
    drive(s, run, stream, until=lambda: len(run.tokens("low")) >= 12)
    s.add(request(lm, "high", grammar, seed=3, priority=5))  # preempts "low", started at once
    drive(s, run, stream, steps=3000)
    assert s.stats.preemptions == 1 and s.stats.started_at_once == 1
    assert run.tokens("low") == plain.tokens("low")
    Order.model_validate_json(run.text("high"))
    high_alone = generate(lm, stream, [request(lm, "high", grammar, seed=3)], capacity=1)
    assert run.tokens("high") == high_alone.tokens("high")


def test_a_grammar_is_compiled_once_and_cached(grammars: Grammars) -> None:
    fmt = ResponseFormat(FormatKind.REGEX, "[0-9]{3}")
    before = grammars.compiled
    first = grammars.compile(fmt)
    assert grammars.compile(fmt) is first and grammars.cached(fmt) is first
    assert grammars.compiled == before + 1


@pytest.mark.parametrize(("fmt", "says"), [
    (ResponseFormat(FormatKind.JSON_SCHEMA, '{"type": "no-such-type"}'), "json_schema"),
    (ResponseFormat(FormatKind.JSON_SCHEMA, "[1, 2]"), "not a JSON object"),
    (ResponseFormat(FormatKind.JSON_SCHEMA, "{not json"), "not valid"),
    (ResponseFormat(FormatKind.REGEX, "(unclosed"), "regex"),
    (ResponseFormat(FormatKind.LARK, "start: undefined_rule"), "lark"),
    (ResponseFormat(FormatKind.REGEX, "a" * (65 << 10)), "at most"),
])
def test_a_format_that_cannot_compile_is_refused_with_why(grammars: Grammars, fmt: ResponseFormat, says: str) -> None:
    with pytest.raises(GrammarError, match=says):
        grammars.compile(fmt)


def test_a_format_the_matcher_cannot_follow_ends_the_row_with_bad_request(tiny_think_model: Path,
                                                                          stream: mx.Stream) -> None:
    # llguidance takes an added token (here the think end) as special: a regex that spells its text gets it in
    # the mask, then refuses it. The row ends with an error, not with text that stops matching its format.
    import mlx_lm

    lm = mlx_lm.load(str(tiny_think_model))
    model, tokenizer = lm
    grammars = Grammars(tokenizer._tokenizer, vocab_size(model, tokenizer), tokenizer.eos_token_ids)
    grammar = grammars.compile(ResponseFormat(FormatKind.REGEX, "[a-z]{3,8}</think>[a-z]{3,8}"))
    run = generate(lm, stream, [request(lm, "r", grammar, max_tokens=30)])
    last = run.final("r")
    assert last.finish is FinishReason.ERROR and last.error_code == "bad_request"
    assert last.error_message is not None and "could not go on in its format" in last.error_message


def test_every_token_of_a_constrained_row_is_sampled_by_the_batchs_masked_step(
        lm: Any, stream: mx.Stream, grammars: Grammars, monkeypatch: pytest.MonkeyPatch) -> None:
    # The batch's own classes (not a patch of mlx-lm's): its first token, sampled as its prefill ends, too.
    import mlxq.engine.mlx.generation as generation

    filled: list[list[int]] = []  # each masked step's fed tokens
    fill = generation.fill_masks

    def recorded(masks: Any, fed: list[int], *rest: Any) -> Any:
        filled.append(list(fed))
        return fill(masks, fed, *rest)

    monkeypatch.setattr(generation, "fill_masks", recorded)
    s = scheduler(lm, stream)
    gen = s.backend._gen  # type: ignore[attr-defined]
    assert type(gen._prompt_batch) is generation.MaskedPromptBatch
    assert type(gen._generation_batch) is generation.MaskedGenerationBatch
    r = request(lm, "r", grammars.compile(schema_format(Order)), max_tokens=6)
    run = Run()
    s.add(r)
    drive(s, run, stream, steps=3000)
    tokens = run.tokens("r")
    assert len(tokens) == 6 and run.final("r").finish is FinishReason.LENGTH
    assert filled[0] == r.prompt_tokens[-1:]  # the step that sampled the first token fed the prompt's last
    assert [f[0] for f in filled[1:6]] == tokens[:5]
