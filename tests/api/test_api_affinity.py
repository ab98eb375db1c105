"""A job's affinity key (api/affinity.py): the request's prompt_cache_key, else derived from what stays the same
across a conversation's turns; hashed per model; carried at the tail of the job record, where CLAIM reads it."""

from __future__ import annotations

import json

import pytest

from mlxq.api.affinity import KEY_HEX, MAX_KEYS, PROMPT_CHARS, SYSTEM_CHARS, affinity_key, affinity_keys
from mlxq.api.errors import BadRequest
from mlxq.api.protocol.jobrecord import job_record, read_job
from mlxq.api.schema import MAX_CACHE_KEY_CHARS, GenerateRequest

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}
TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}


def chat(*turns: dict[str, str], model: str = "m", **fields: object) -> GenerateRequest:
    return GenerateRequest(model=model, messages=list(turns), **fields)


def test_a_conversations_turns_share_one_key_and_other_conversations_get_theirs() -> None:
    first = chat(SYSTEM, {"role": "user", "content": "hello"})
    later = chat(SYSTEM, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                 {"role": "user", "content": "and then?"})
    other = chat(SYSTEM, {"role": "user", "content": "something else"})
    key = affinity_key(first)
    assert len(key) == KEY_HEX and int(key, 16) >= 0
    assert affinity_key(later) == key
    assert affinity_key(other) != key  # same system prompt, another conversation
    assert affinity_key(chat({"role": "user", "content": "hello"})) != key  # no system turn: another start


def test_tools_and_the_model_are_part_of_the_key() -> None:
    turn = {"role": "user", "content": "hello"}
    assert affinity_key(chat(SYSTEM, turn, tools=[TOOL])) != affinity_key(chat(SYSTEM, turn))
    assert affinity_key(chat(SYSTEM, turn, model="other")) != affinity_key(chat(SYSTEM, turn))


def test_prompt_cache_key_wins_and_is_namespaced_by_model() -> None:
    a = chat(SYSTEM, {"role": "user", "content": "one"}, prompt_cache_key="conv-1")
    b = chat({"role": "user", "content": "two"}, prompt_cache_key="conv-1")
    assert affinity_key(a) == affinity_key(b)
    assert affinity_key(chat({"role": "user", "content": "x"}, model="n", prompt_cache_key="conv-1")) != affinity_key(a)
    assert "conv-1" not in affinity_key(a)  # hashed, never stored whole


def test_a_raw_prompt_keys_on_its_start_and_a_short_one_gets_none() -> None:
    long = "Instructions. " * (PROMPT_CHARS // 10)
    assert affinity_key(GenerateRequest(model="m", prompt="short prompt")) == ""
    key = affinity_key(GenerateRequest(model="m", prompt=long))
    assert key and affinity_key(GenerateRequest(model="m", prompt=long + " and a further turn")) == key
    assert affinity_key(GenerateRequest(model="m", prompt="Other. " + long)) != key


def test_a_bad_prompt_cache_key_is_refused_naming_the_field() -> None:
    from mlxq.api.client import _request

    for bad in ("", "k" * (MAX_CACHE_KEY_CHARS + 1), 42):
        with pytest.raises(BadRequest, match="prompt_cache_key"):
            _request(None, {"model": "m", "prompt": "x", "prompt_cache_key": bad})


def test_the_job_record_ends_with_the_key_and_the_enqueue_time() -> None:
    record = job_record({"model": "m", "prompt": "x"}, 1234, "00ff00ff00ff00ff")
    assert record.endswith(b'"ak":"00ff00ff00ff00ff","et":1234}')
    envelope = read_job(record, 1 << 20)
    assert envelope.affinity == "00ff00ff00ff00ff" and envelope.enqueue_ms == 1234 and not envelope.problem
    plain = job_record({"model": "m", "prompt": "x"}, 1234)
    assert "ak" not in json.loads(plain) and read_job(plain, 1 << 20).affinity == ""


def test_the_openai_gateway_passes_prompt_cache_key_and_refuses_a_bad_one() -> None:
    from mlxq.api.gateway.config import GatewayConfig
    from mlxq.api.gateway.errors import GatewayError
    from mlxq.api.gateway.openai_api import CHAT, COMPLETIONS

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "conv-7"}
    ask = CHAT.parse(json.dumps(body).encode(), GatewayConfig())
    assert ask.request.prompt_cache_key == "conv-7"
    assert affinity_key(ask.request) == affinity_key(chat({"role": "user", "content": "other"},
                                                          prompt_cache_key="conv-7"))
    plain = CHAT.parse(json.dumps({**body, "prompt_cache_key": None}).encode(), GatewayConfig())
    assert plain.request.prompt_cache_key is None
    completion = {"model": "m", "prompt": "hello", "prompt_cache_key": "conv-7"}
    assert COMPLETIONS.parse(json.dumps(completion).encode(), GatewayConfig()).request.prompt_cache_key == "conv-7"
    with pytest.raises(GatewayError, match="prompt_cache_key"):
        CHAT.parse(json.dumps({**body, "prompt_cache_key": "k" * 300}).encode(), GatewayConfig())


LONG_SYSTEM = {"role": "system", "content": "You classify support tickets by their product and urgency. " * 20}


def test_a_long_system_prompt_gets_a_second_shallower_key_shared_by_single_turn_requests() -> None:
    one = chat(LONG_SYSTEM, {"role": "user", "content": "My invoice is wrong."})
    two = chat(LONG_SYSTEM, {"role": "user", "content": "The app crashes."})
    later = chat(LONG_SYSTEM, {"role": "user", "content": "My invoice is wrong."},
                 {"role": "assistant", "content": "billing"}, {"role": "user", "content": "And this one?"})
    (deep_one, system), (deep_two, system_two) = affinity_keys(one), affinity_keys(two)
    assert system == system_two and deep_one != deep_two  # the system prompt shared, the conversations not
    assert affinity_keys(later) == (deep_one, system)  # deepest first, the same for every turn
    assert affinity_key(one) == deep_one and len(system) == KEY_HEX and system not in (deep_one, deep_two)
    tools = chat(LONG_SYSTEM, {"role": "user", "content": "x"}, tools=[TOOL])
    assert affinity_keys(tools)[1] != system  # the tools are part of the system prompt's key
    assert len(affinity_keys(chat(LONG_SYSTEM, {"role": "user", "content": "x"}, model="other"))) == 2
    assert affinity_keys(chat(LONG_SYSTEM, {"role": "user", "content": "x"}, model="other"))[1] != system


def test_a_short_system_prompt_a_cache_key_and_a_raw_prompt_get_one_key() -> None:
    short = {"role": "system", "content": "You are brief."}
    assert len(affinity_keys(chat(short, {"role": "user", "content": "hello"}))) == 1
    long_enough = {"role": "system", "content": "s" * SYSTEM_CHARS}
    assert len(affinity_keys(chat(long_enough, {"role": "user", "content": "x"}))) == 2
    assert len(affinity_keys(chat(LONG_SYSTEM, {"role": "user", "content": "x"}, prompt_cache_key="k"))) == 1
    assert len(affinity_keys(GenerateRequest(model="m", prompt="Instructions. " * PROMPT_CHARS))) == 1
    assert affinity_keys(GenerateRequest(model="m", prompt="short")) == ()


def test_the_job_record_carries_every_key_deepest_first_where_claim_reads_them() -> None:
    from mlxq.api.protocol.claim import Affinity, _placed

    keys = ("00ff00ff00ff00ff", "11ee11ee11ee11ee")
    record = job_record({"model": "m", "prompt": "x"}, 1_700_000_000_000, keys)
    assert record.endswith(b'"ak":"00ff00ff00ff00ff,11ee11ee11ee11ee","et":1700000000000}')
    envelope = read_job(record, 1 << 20)
    assert envelope.affinity == keys[0] and envelope.keys == keys
    assert _placed(b"?", record) is Affinity.NONE  # nobody advertised: a keyed job counts "none"
    most = job_record({"model": "m", "prompt": "x"}, 1_700_000_000_000, ["ab" * 8] * MAX_KEYS)
    assert b'"ak":' in most[-128:]  # CLAIM's read of the tail reaches every key
