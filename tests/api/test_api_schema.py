"""The wire schema: request validation, event JSON round trips, the ``type`` discriminator."""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlxq.api.schema import (
    EVENTS,
    MAX_EMBED_INPUTS,
    MAX_METADATA_ITEMS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_CEILING,
    ChatMessage,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    FinishReason,
    GenerateRequest,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    ToolCall,
    Usage,
    decode_event,
    decode_vector,
    is_terminal,
    new_request_id,
    token_event_json,
)

pytestmark = pytest.mark.unit


def req(**fields: object) -> GenerateRequest:
    base: dict[str, object] = {"model": "m", "prompt": "hello"}
    base.update(fields)
    return GenerateRequest(**base)  # type: ignore[arg-type]


def error_types(exc: pytest.ExceptionInfo[ValidationError]) -> set[str]:
    return {e["type"] for e in exc.value.errors()}


# --- GenerateRequest -----------------------------------------------------------------------------------


def test_prompt_request_defaults() -> None:
    r = req()
    assert r.prompt == "hello"
    assert r.messages is None
    assert r.max_tokens == 256
    assert r.temperature == 0.0
    assert r.stop == []
    assert r.metadata == {}
    assert re.fullmatch(r"[0-9a-f]{32}", r.id)


def test_default_ids_are_unique() -> None:
    assert len({req().id for _ in range(50)}) == 50
    assert new_request_id() != new_request_id()


def test_messages_request_is_accepted() -> None:
    r = GenerateRequest(model="m", messages=[ChatMessage(role="user", content="hi")])
    assert r.prompt is None
    assert r.messages is not None and r.messages[0].content == "hi"


def test_messages_from_plain_dicts() -> None:
    r = GenerateRequest.model_validate(
        {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    )
    assert r.messages is not None
    assert [m.role for m in r.messages] == ["system", "user"]


def test_both_prompt_and_messages_rejected() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest(model="m", prompt="p", messages=[ChatMessage(role="user", content="u")])


def test_neither_prompt_nor_messages_rejected() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest(model="m")


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        req(prompt="")
    assert "string_too_short" in error_types(exc)


def test_empty_messages_rejected() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest(model="m", messages=[])


def test_bad_message_role_rejected() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"model": "m", "messages": [{"role": "robot", "content": "x"}]})


def test_empty_model_rejected() -> None:
    with pytest.raises(ValidationError):
        req(model="")


@pytest.mark.parametrize("value", [0, -1, MAX_TOKENS_CEILING + 1])
def test_max_tokens_out_of_range_rejected(value: int) -> None:
    with pytest.raises(ValidationError):
        req(max_tokens=value)


@pytest.mark.parametrize("value", [1, MAX_TOKENS_CEILING])
def test_max_tokens_bounds_accepted(value: int) -> None:
    assert req(max_tokens=value).max_tokens == value


@pytest.mark.parametrize("value", [-0.01, 100.01, math.nan, math.inf])
def test_temperature_out_of_range_rejected(value: float) -> None:
    with pytest.raises(ValidationError):
        req(temperature=value)


@pytest.mark.parametrize("value", [0.0, 0.7, 100.0])
def test_temperature_in_range_accepted(value: float) -> None:
    assert req(temperature=value).temperature == value


@pytest.mark.parametrize("value", [0.0, -0.5, 1.01, math.nan])
def test_top_p_out_of_range_rejected(value: float) -> None:
    with pytest.raises(ValidationError):
        req(top_p=value)


@pytest.mark.parametrize("value", [0.01, 1.0])
def test_top_p_in_range_accepted(value: float) -> None:
    assert req(top_p=value).top_p == value


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", -1),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 101.0),
        ("seed", -1),
        ("seed", 2**63),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("priority", 101),
        ("priority", -101),
        ("expires_in", -1.0),
        ("expires_in", 86_401.0),
    ],
)
def test_other_sampling_bounds_rejected(field: str, value: float) -> None:
    with pytest.raises(ValidationError):
        req(**{field: value})


def test_stop_list_bounds() -> None:
    assert len(req(stop=["x"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    with pytest.raises(ValidationError):
        req(stop=["x"] * (MAX_STOP_STRINGS + 1))


def test_stop_string_length_bounds() -> None:
    assert req(stop=["s" * MAX_STOP_CHARS]).stop == ["s" * MAX_STOP_CHARS]
    with pytest.raises(ValidationError):
        req(stop=["s" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValidationError):
        req(stop=[""])


def test_metadata_bounds() -> None:
    ok = {f"k{i}": "v" for i in range(MAX_METADATA_ITEMS)}
    assert req(metadata=ok).metadata == ok
    with pytest.raises(ValidationError):
        req(metadata={f"k{i}": "v" for i in range(MAX_METADATA_ITEMS + 1)})
    with pytest.raises(ValidationError):
        req(metadata={"k" * 65: "v"})
    with pytest.raises(ValidationError):
        req(metadata={"k": "v" * 1025})
    assert req(metadata={"k" * 64: "v" * 1024}).metadata == {"k" * 64: "v" * 1024}


def test_metadata_values_must_be_strings() -> None:
    with pytest.raises(ValidationError):
        req(metadata={"k": {"nested": "x"}})


def test_unknown_field_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        req(max_new_tokens=5)
    assert "extra_forbidden" in error_types(exc)


def test_unknown_field_in_message_rejected() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x", "nick": "b"}]})


@pytest.mark.parametrize("rid", ["a", "abc-123_X.y:z", "x" * 64, "new"])
def test_valid_ids_accepted(rid: str) -> None:
    rid = new_request_id() if rid == "new" else rid  # (a fresh id, drawn in the test: collections agree)
    assert req(id=rid).id == rid


@pytest.mark.parametrize("rid", ["", "x" * 65, "has space", "a/b", "{tag}", "é", "a\n"])
def test_invalid_ids_rejected(rid: str) -> None:
    with pytest.raises(ValidationError):
        req(id=rid)


def test_request_is_frozen() -> None:
    r = req()
    with pytest.raises(ValidationError):
        r.max_tokens = 5  # type: ignore[misc]


def test_request_json_round_trip() -> None:
    r = req(
        id="job-1",
        stop=["\n\n", "END"],
        metadata={"user": "u1"},
        temperature=0.5,
        top_p=0.9,
        seed=7,
        repetition_penalty=1.1,
    )
    wire = json.dumps(r.model_dump(mode="json"))
    back = GenerateRequest(**json.loads(wire))
    assert back == r
    assert GenerateRequest.model_validate_json(r.model_dump_json()) == r


# --- events --------------------------------------------------------------------------------------------

TIMINGS = Timings(queue_ms=1.5, ttft_ms=10.0, total_ms=100.25, tokens_per_s=42.0)
ALL_EVENTS = [
    StartEvent(id="r1", seq=0, model="m", worker="w1", prompt_tokens=12, attempt=2),
    TokenEvent(id="r1", seq=1, text="héllo ✓", token_ids=[1, 2, 3], index=0),
    ResetEvent(id="r1", seq=2, reason="worker lost", attempt=2),
    DoneEvent(
        id="r1",
        seq=3,
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=12, completion_tokens=3),
        timings=TIMINGS,
    ),
    ErrorEvent(id="r1", seq=4, code=ErrorCode.TIMEOUT, message="too slow", retryable=True),
]


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: e.type)
def test_event_json_round_trip(event: object) -> None:
    data = event.model_dump_json()  # type: ignore[attr-defined]
    for wire in (data, data.encode()):
        back = decode_event(wire)
        assert type(back) is type(event)
        assert back == event
    assert EVENTS.validate_python(json.loads(data)) == event
    assert json.loads(EVENTS.dump_json(event)) == json.loads(data)


@pytest.mark.parametrize(
    "event,type_",
    [
        (ALL_EVENTS[0], "start"),
        (ALL_EVENTS[1], "token"),
        (ALL_EVENTS[2], "reset"),
        (ALL_EVENTS[3], "done"),
        (ALL_EVENTS[4], "error"),
    ],
)
def test_event_type_tag_is_serialized(event: object, type_: str) -> None:
    assert json.loads(event.model_dump_json())["type"] == type_  # type: ignore[attr-defined]


def test_discriminator_selects_model_from_type() -> None:
    payload = {"type": "token", "id": "r", "seq": 5, "text": "x", "token_ids": [9], "index": 4}
    ev = decode_event(json.dumps(payload))
    assert isinstance(ev, TokenEvent)
    assert (ev.seq, ev.text, ev.token_ids, ev.index) == (5, "x", [9], 4)


def test_done_event_enums_decoded_from_strings() -> None:
    ev = decode_event(
        json.dumps(
            {
                "type": "done",
                "id": "r",
                "seq": 1,
                "finish_reason": "cancelled",
                "usage": {"prompt_tokens": 1, "completion_tokens": 0},
                "timings": {"queue_ms": 0, "ttft_ms": None, "total_ms": 1, "tokens_per_s": None},
            }
        )
    )
    assert isinstance(ev, DoneEvent)
    assert ev.finish_reason is FinishReason.CANCELLED
    assert ev.timings.ttft_ms is None


def test_error_event_defaults_not_retryable() -> None:
    payload = {"type": "error", "id": "r", "seq": 0, "code": "bad_request", "message": "m"}
    ev = decode_event(json.dumps(payload))
    assert isinstance(ev, ErrorEvent)
    assert ev.code is ErrorCode.BAD_REQUEST
    assert ev.retryable is False


@pytest.mark.parametrize(
    "payload",
    [
        {"type": "bogus", "id": "r", "seq": 0},
        {"id": "r", "seq": 0, "text": "x", "token_ids": [], "index": 0},  # no type
        {"type": "token", "id": "r", "seq": -1, "text": "x", "token_ids": [], "index": 0},  # negative seq
        {"type": "token", "id": "r", "seq": 0, "text": "x", "token_ids": [], "index": 0, "extra": 1},
        {"type": "token", "id": "r", "seq": 0, "text": "x", "index": 0},  # missing token_ids
        {"type": "error", "id": "r", "seq": 0, "code": "no_such_code", "message": "m"},
        {
            "type": "done",
            "id": "r",
            "seq": 0,
            "finish_reason": "error",
            "usage": {"prompt_tokens": 1, "completion_tokens": 0},
            "timings": {"queue_ms": 0, "ttft_ms": None, "total_ms": 1, "tokens_per_s": None},
        },
    ],
)
def test_invalid_events_rejected(payload: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        decode_event(json.dumps(payload))


def test_type_must_match_fields() -> None:
    # A start payload tagged as token is validated as a token (and fails), not silently coerced.
    with pytest.raises(ValidationError):
        decode_event(
            json.dumps({"type": "token", "id": "r", "seq": 0, "model": "m", "worker": "w", "prompt_tokens": 1})
        )


def test_malformed_json_rejected() -> None:
    with pytest.raises(ValidationError):
        decode_event(b"{not json")


def test_is_terminal() -> None:
    assert [is_terminal(e) for e in ALL_EVENTS] == [False, False, False, True, True]


@settings(max_examples=200, deadline=None)
@given(rid=st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True), seq=st.integers(0, 2**40),
       text=st.text(), token_ids=st.lists(st.integers(0, 2**31)), index=st.integers(0, 2**31),
       reasoning=st.text())
def test_token_event_json_is_pydantics_own_json(rid: str, seq: int, text: str, token_ids: list[int],
                                                index: int, reasoning: str) -> None:
    fast = token_event_json(rid, seq, text, token_ids, index, reasoning)
    event = TokenEvent(id=rid, seq=seq, text=text, token_ids=token_ids, index=index, reasoning=reasoning)
    assert fast == event.model_dump_json()
    assert decode_event(fast) == event
    if not reasoning:  # what a client of an earlier release reads, byte for byte
        assert '"reasoning"' not in fast


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(("fields", "says"), [
    ({"tools": [TOOL], "prompt": "hi", "messages": None}, "tools need chat messages"),
    ({"tools": [TOOL, TOOL]}, "tool names must be unique"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "none of the tools"),
    ({"tool_choice": "required"}, "tool_choice requires tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "string_pattern_mismatch"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both hold"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "assistant messages only"),
])
def test_bad_tools_are_refused_with_what_is_wrong(fields: dict[str, Any], says: str) -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError) as exc:
        GenerateRequest.model_validate({**base, **fields})
    assert says in str(exc.value)


def test_tools_and_a_tool_loop_round_trip() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    req = GenerateRequest.model_validate({"model": "m", "tools": [TOOL], "tool_choice": "auto", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]})
    assert req.calls_tools and GenerateRequest.model_validate_json(req.model_dump_json()) == req
    assert req.messages is not None and req.messages[1].content == ""
    assert not req.model_copy(update={"tool_choice": "none"}).calls_tools
    done = DoneEvent(id="r", seq=3, finish_reason=FinishReason.TOOL_CALLS, usage=Usage(prompt_tokens=1,
                     completion_tokens=2), timings=Timings(queue_ms=0, ttft_ms=1, total_ms=2, tokens_per_s=None),
                     tool_calls=[ToolCall.model_validate(call)])
    assert decode_event(done.model_dump_json()) == done
    assert '"tool_calls":' not in done.model_copy(update={"tool_calls": None}).model_dump_json()


# --- embedding jobs ---------------------------------------------------------------------------------
def test_an_embedding_job_gives_input_texts_or_token_id_lists_and_nothing_else() -> None:
    texts = GenerateRequest(model="m", input=["a", "b"], dimensions=8)
    assert texts.embeds and texts.input == ["a", "b"] and texts.dimensions == 8
    ids = GenerateRequest(model="m", input=[[1, 2], [3]])
    assert ids.embeds and ids.input == [[1, 2], [3]]
    assert not GenerateRequest(model="m", prompt="p").embeds
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest(model="m", prompt="p", input=["a"])
    with pytest.raises(ValidationError, match="dimensions are for an embedding job"):
        GenerateRequest(model="m", prompt="p", dimensions=8)


@pytest.mark.parametrize("given", [[], [""], [[]], [["a"]], [[-1]], [[1], "a"]])
def test_an_empty_or_malformed_input_is_refused(given: Any) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest(model="m", input=given)


def test_too_many_inputs_or_dimensions_below_one_are_refused() -> None:
    with pytest.raises(ValidationError):
        GenerateRequest(model="m", input=["a"] * (MAX_EMBED_INPUTS + 1))
    with pytest.raises(ValidationError):
        GenerateRequest(model="m", input=["a"], dimensions=0)


def test_a_done_events_embeddings_are_base64_little_endian_float32_left_out_when_none() -> None:
    vector = [0.5, -0.25, 1e-3]
    data = base64.b64encode(struct.pack("<3f", *vector)).decode()
    usage, timings = Usage(prompt_tokens=3, completion_tokens=0), Timings(queue_ms=1, ttft_ms=None, total_ms=2,
                                                                          tokens_per_s=None)
    done = DoneEvent(id="j", seq=1, finish_reason=FinishReason.STOP, usage=usage, timings=timings, embeddings=[data])
    back = decode_event(done.model_dump_json())
    assert isinstance(back, DoneEvent) and back.embeddings == [data]
    assert decode_vector(data) == pytest.approx(vector)
    plain = DoneEvent(id="j", seq=1, finish_reason=FinishReason.STOP, usage=usage, timings=timings)
    assert "embeddings" not in plain.model_dump_json()
