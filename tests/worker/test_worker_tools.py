"""Tool calls through the queue: a real Redis and worker on a generated model whose template renders tools in
the Hermes format (mlx-lm's json_tools parser). The random weights call tools only when constrained to, which
is what tool_choice required or named does; under auto, a grammar puts a call where the test wants one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest, JobFailed
from mlxq.api.schema import FinishReason
from tests.support import config_with, start_worker

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Paris?"}]


def valid(name: str, args: dict[str, Any], tools: list[dict[str, Any]]) -> bool:
    """Whether ``args`` are arguments of the tool ``name`` of ``tools`` that hold what its schema bounds."""
    (tool,) = [t["function"] for t in tools if t["function"]["name"] == name]
    props = tool["parameters"]["properties"]
    if set(args) != set(tool["parameters"]["required"]) or set(args) - set(props):
        return False
    for key, value in args.items():
        spec = props[key]
        if spec["type"] == "string":
            ok = isinstance(value, str) and len(value) <= spec.get("maxLength", 1 << 30)
            ok = ok and value in spec.get("enum", [value])
        else:
            ok = isinstance(value, int) and spec["minimum"] <= value <= spec["maximum"]
        if not ok:
            return False
    return True


def valid_call(call: Any, tools: list[dict[str, Any]]) -> bool:
    return valid(call.function.name, json.loads(call.function.arguments), tools)


@pytest.fixture
async def tools_worker(worker_config: Any, tiny_tools_model: Path) -> Any:
    running = await start_worker(config_with(worker_config, model=str(tiny_tools_model), model_name="tools"))
    yield running
    await running.close()


async def test_required_and_named_tool_choice_give_valid_calls(tools_worker: Any, client: Client) -> None:
    tools = [WEATHER, CLOCK]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        result = await client.generate(model="tools", messages=MESSAGES, tools=tools, tool_choice=choice,
                                       max_tokens=400, timeout=60)
        assert result.finish_reason is FinishReason.TOOL_CALLS and result.tool_calls, result
        assert all(valid_call(call, tools) for call in result.tool_calls)
        assert result.text.strip() == ""  # the calls are not text
        if isinstance(choice, dict):
            assert [c.function.name for c in result.tool_calls] == ["get_time"]
        ids = [c.id for c in result.tool_calls]
        assert len(set(ids)) == len(ids) and all(i.startswith(f"call_{result.id}") for i in ids)
    # One call at most without parallel calls; the token events carry each call as it completes.
    rid = await client.submit(model="tools", messages=MESSAGES, tools=tools, tool_choice="required",
                              parallel_tool_calls=False, max_tokens=400)
    events = [ev async for ev in client.events(rid, timeout=60)]
    streamed = [c for ev in events if ev.type == "token" for c in ev.tool_calls or ()]
    done = events[-1]
    assert done.type == "done" and len(streamed) == 1 and done.tool_calls == streamed
    deltas = [d async for d in client.stream_deltas(rid, timeout=60)]  # the client's own reader of the parts
    assert [c for d in deltas for c in d.tool_calls] == streamed


async def test_a_required_call_cut_by_max_tokens_leaves_no_markup_in_the_text(tools_worker: Any,
                                                                             client: Client) -> None:
    # OpenAI's closest: finish_reason length, no call (its name may not even be whole), no markup in the content.
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        result = await client.generate(model="tools", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=choice,
                                       max_tokens=4, timeout=60)
        assert result.finish_reason is FinishReason.LENGTH and not result.tool_calls, result
        assert "<tool_call>" not in result.text and result.text.strip() == "", result.text


async def test_a_two_turn_tool_loop(tools_worker: Any, client: Client) -> None:
    first = await client.generate(model="tools", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=400, timeout=60)
    (call,) = first.tool_calls
    follow = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = await client.generate(model="tools", messages=follow, tools=[WEATHER], max_tokens=8, timeout=60)
    assert second.finish_reason is FinishReason.LENGTH and second.text and not second.tool_calls
    # The follow-up turn went through the template: its prompt holds the call and the result.
    tokenizer = tools_worker.service.model.tokenizer
    prompt = tokenizer.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                            "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=[WEATHER], add_generation_prompt=True)
    assert second.usage.prompt_tokens == len(prompt)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tokenizer.decode(prompt)


async def test_auto_parses_what_the_model_writes(tools_worker: Any, client: Client) -> None:
    # A grammar (a response format holds under auto) makes the random model write text, then a call in the model's
    # format, then a malformed one.
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    grammar = f'start: "Let me check." <[512]> "\\n{_lark(call)}\\n" <[513]> " And" <[512]> "oops" <[513]>'
    ask = {"model": "tools", "messages": MESSAGES, "tools": [CLOCK], "max_tokens": 80,
           "response_format": {"type": "grammar", "grammar": grammar}}
    result = await client.generate(**ask, timeout=60)
    assert result.finish_reason is FinishReason.TOOL_CALLS
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == [
        ("get_time", {"zone": "UTC"})]
    assert result.text == "Let me check. And<tool_call>oops</tool_call>"  # what does not parse stays text
    # tool_choice none: the model is not shown the tools and what it writes is all answer.
    none = await client.generate(**{**ask, "tool_choice": "none"}, timeout=60)
    assert none.finish_reason is FinishReason.STOP and not none.tool_calls
    assert none.text.startswith("Let me check.<tool_call>\n{") and none.usage.prompt_tokens < result.usage.prompt_tokens
    with pytest.raises(BadRequest):  # a response format and a constrained call cannot both hold: refused at once
        await client.generate(**{**ask, "tool_choice": "required"})


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


async def test_tool_choice_a_model_cannot_constrain_is_refused_with_one_error(worker: Any, client: Client) -> None:
    # The plain tiny model has no tool-call format: auto answers in text, required is refused by the worker.
    plain = await client.generate(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=6, timeout=60)
    assert plain.finish_reason is FinishReason.LENGTH and plain.text and not plain.tool_calls
    with pytest.raises(JobFailed) as failed:
        await client.generate(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                              max_tokens=6, timeout=60)
    assert failed.value.event.code.value == "bad_request" and "json_tools" in failed.value.event.message


def test_a_call_that_does_not_parse_stays_in_the_text() -> None:
    from mlx_lm.tool_parsers.json_tools import parse_tool_call

    from mlxq.worker.jobs.toolcalls import ToolCalls

    calls = ToolCalls("r1", parse_tool_call, [CLOCK], ("<tool_call>", "</tool_call>"))
    got, rest = calls.take(['\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n', "{nope", '{"name": "f"}',
                            '{"name": "g", "arguments": "[1]"}', '{"name": "h", "arguments": "{\\"x\\": 1}"}'])
    assert [(c.id, c.function.name, c.function.arguments) for c in got] == [
        ("call_r1_0", "get_time", '{"zone": "UTC"}'), ("call_r1_1", "f", "{}"), ("call_r1_2", "h", '{"x": 1}')]
    assert rest == '<tool_call>{nope</tool_call><tool_call>{"name": "g", "arguments": "[1]"}</tool_call>'
    assert calls.calls == got
