"""A Responses API request as the chat request it amounts to (``api/gateway/response_input.py``), with no queue:
items become chat messages (a call joins its turn's text), flat tools nested ones, a chain's turns share the
root's affinity key, and what is not supported is refused naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxq.api.gateway import GatewayConfig
from mlxq.api.gateway.errors import GatewayError
from mlxq.api.gateway.response_input import input_items, parse_request, to_ask

pytestmark = pytest.mark.unit

CONFIG = GatewayConfig()
TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def ask(body: dict[str, Any], context: list[dict[str, Any]] | None = None, key: str | None = None) -> Any:
    req = parse_request(json.dumps({"model": "m", **body}).encode())
    return to_ask(req, context or [], input_items(req, "resp_abc"), CONFIG, key).request


def test_items_become_the_chat_turns_and_instructions_come_first() -> None:
    context: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "time?"}]},
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see.",
                                                               "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}]
    job = ask({"instructions": "Be brief.", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"},
               "input": [{"type": "function_call_output", "call_id": "c1", "output": "noon"}]}, context, "resp_root")
    turns = [(m.role, m.content, [c.function.name for c in m.tool_calls or []]) for m in job.messages]
    assert turns == [("system", "Be brief.", []), ("user", "time?", []), ("assistant", "Let me see.", ["get_time"]),
                     ("tool", "noon", [])]
    assert job.messages[-1].tool_call_id == "c1" and job.messages[-1].name == "get_time"
    assert job.tools[0].function.name == "get_time" and job.tool_choice.function.name == "get_time"
    assert job.prompt_cache_key == "resp_root" and job.reasoning == "split"


def test_a_request_maps_as_chat_would_and_its_own_cache_key_wins() -> None:
    job = ask({"input": "hi", "max_output_tokens": 7, "temperature": 0.5, "metadata": {"a": "b"},
               "prompt_cache_key": "mine", "text": {"format": {"type": "json_schema", "name": "T",
                                                               "schema": {"type": "object"}}},
               "reasoning": {"effort": "none"}}, key="resp_root")
    assert (job.max_tokens, job.fit_max_tokens, job.temperature, job.metadata) == (7, False, 0.5, {"a": "b"})
    assert job.prompt_cache_key == "mine" and job.enable_thinking is False
    assert job.response_format.type == "json_schema" and job.response_format.json_schema.name == "T"
    items = input_items(parse_request(b'{"model": "m", "input": "hi"}'), "resp_abc")
    assert items == [{"type": "message", "role": "user", "id": "msg_in_abc_0",
                      "content": [{"type": "input_text", "text": "hi"}]}]


@pytest.mark.parametrize(("body", "named"), [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file'"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "'web_search'"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "'xml'"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "conversation": "c"}, "conversation"),
])
def test_what_is_not_supported_is_a_400_naming_it(body: dict[str, Any], named: str) -> None:
    with pytest.raises(GatewayError, match=named) as refused:
        ask(body)
    assert refused.value.problem.status == 400
