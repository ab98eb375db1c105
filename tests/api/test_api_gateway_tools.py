"""Tool calls through the gateway with the official SDKs: OpenAI's tools, tool_choice and streamed tool_calls,
Anthropic's tools, tool_choice, tool_use blocks (streamed as input_json_delta) and tool_result turns; a two-turn
tool loop with each. A real gateway, Redis and worker process on a generated model whose template renders
tools in the Hermes format (mlx-lm's json_tools parser)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.api.gateway_support import Deployment, ServedGateway, deployment, post
from tests.worker.test_worker_tools import CLOCK, WEATHER, valid, valid_call

pytestmark = pytest.mark.e2e

MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: Any = [WEATHER, CLOCK]
ANTHROPIC_TOOLS: Any = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "input_schema": t["function"]["parameters"]} for t in TOOLS]



class OpenPlace(BaseModel):  # the schemas of the Open* models leave additionalProperties unspecified
    city: str = Field(max_length=12)
    country: str = Field(max_length=3)


class OpenTrip(BaseModel):
    origin: OpenPlace
    days: int = Field(ge=1, le=7)


class Place(OpenPlace):
    model_config = ConfigDict(extra="forbid")


class Trip(OpenTrip):
    model_config = ConfigDict(extra="forbid")  # checks the arguments: no key the schema does not name

    origin: Place


# The weather tool as a schema that leaves additionalProperties unspecified, and a tool of nested models ($defs).
OPEN_WEATHER: Any = {"type": "function", "function": {**WEATHER["function"], "parameters": {
    k: v for k, v in WEATHER["function"]["parameters"].items() if k != "additionalProperties"}}}
TRIP: Any = {"type": "function", "function": {"name": "plan_trip", "parameters": OpenTrip.model_json_schema()}}
OPEN_TOOLS: Any = [OPEN_WEATHER, TRIP]


def open_call_is_valid(name: str, args: dict[str, Any]) -> bool:
    """Whether ``args`` are arguments of the tool ``name`` of :data:`OPEN_TOOLS` with only the keys it names."""
    if name == "plan_trip":
        Trip.model_validate(args)
        return True
    return valid(name, args, [WEATHER])


@pytest.fixture(scope="module")
def served(tiny_tools_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_tools_model, tmp_path_factory.mktemp("gw-tools")) as running:
        yield running


async def test_openai_required_and_named_calls_whole_and_streamed(oai: openai.AsyncOpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=400)
        choice0 = resp.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.tool_calls
        assert choice0.message.content is None  # as OpenAI's: whitespace around the calls is no answer
        for call in choice0.message.tool_calls:
            assert call.type == "function" and call.id and valid_call(call, TOOLS)
        if isinstance(choice, dict):
            assert {c.function.name for c in choice0.message.tool_calls} == {"get_weather"}

        # Streamed: the SDK's own accumulator rebuilds the same calls from the deltas.
        async with oai.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=400) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        streamed = final.choices[0]
        assert streamed.finish_reason == "tool_calls" and not streamed.message.content  # no whitespace as content
        assert [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] != []
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in choice0.message.tool_calls]  # greedy: the same calls


async def test_openai_calls_to_tools_whose_schemas_leave_additional_properties_unspecified_parse(
        oai: openai.AsyncOpenAI) -> None:
    # Without additionalProperties: false a random-weight model wrote an unnamed key until max_tokens: no calls.
    for choice in ({"type": "function", "function": {"name": "get_weather"}},
                   {"type": "function", "function": {"name": "plan_trip"}}, "required"):
        resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=OPEN_TOOLS,
                                                 tool_choice=choice, max_tokens=400)  # type: ignore[arg-type]
        choice0 = resp.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.tool_calls, choice0
        for call in choice0.message.tool_calls:
            assert call.type == "function"
            assert open_call_is_valid(call.function.name, json.loads(call.function.arguments)), call
        if isinstance(choice, dict):
            assert {c.function.name for c in choice0.message.tool_calls} == {choice["function"]["name"]}


async def test_anthropic_tool_use_of_tools_whose_schemas_leave_additional_properties_unspecified(
        claude: anthropic.AsyncAnthropic) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in OPEN_TOOLS]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "plan_trip"}, {"type": "any"}):
        msg = await claude.messages.create(model="tiny", messages=MESSAGES, tools=tools, tool_choice=choice,
                                           max_tokens=400)  # type: ignore[arg-type]
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses, msg
        assert all(open_call_is_valid(b.name, b.input) for b in uses)  # type: ignore[arg-type]
        if choice["type"] == "tool":
            assert {b.name for b in uses} == {choice["name"]}


async def test_a_required_call_cut_off_by_max_tokens_leaves_no_markup(oai: openai.AsyncOpenAI,
                                                                       claude: anthropic.AsyncAnthropic) -> None:
    # OpenAI's closest: finish_reason length, no call (its name may be cut too), none of the call's markup as text.
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             max_tokens=6)
    (choice,) = resp.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert not (choice.message.content or "").strip(), choice.message.content
    msg = await claude.messages.create(model="tiny", messages=MESSAGES, tools=ANTHROPIC_TOOLS, max_tokens=6,
                                       tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens" and all(b.type == "text" for b in msg.content)
    assert not "".join(b.text for b in msg.content if b.type == "text").strip(), msg.content


async def test_openai_two_turn_tool_loop(oai: openai.AsyncOpenAI) -> None:
    first = await oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=400)
    message = first.choices[0].message
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    follow: Any = [*MESSAGES, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = await oai.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


async def test_anthropic_any_and_named_tool_use_whole_and_streamed(claude: anthropic.AsyncAnthropic) -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        msg = await claude.messages.create(model="tiny", messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                           tool_choice=choice, max_tokens=400)  # type: ignore[arg-type]
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses
        assert all(valid(b.name, b.input, TOOLS) for b in uses)  # type: ignore[arg-type]
        if choice["type"] == "tool":
            assert {b.name for b in uses} == {"get_time"}
        async with claude.messages.stream(model="tiny", messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                          tool_choice=choice, max_tokens=400) as stream:  # type: ignore[arg-type]
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [(b.id, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
            (b.id.replace(msg.id.removeprefix("msg_"), final.id.removeprefix("msg_")), b.name, b.input) for b in uses]


async def test_anthropic_two_turn_tool_loop(claude: anthropic.AsyncAnthropic) -> None:
    first = await claude.messages.create(model="tiny", messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                         max_tokens=400)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    follow: Any = [*MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                                {"type": "text", "text": "And tomorrow?"}]}]
    second = await claude.messages.create(model="tiny", messages=follow, tools=ANTHROPIC_TOOLS, max_tokens=8)
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    assert second.usage.input_tokens > first.usage.input_tokens


async def test_bad_tools_are_refused_before_queueing(served: tuple[Deployment, ServedGateway]) -> None:
    url = served[1].url
    bad = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},  # names no tool
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        {"tool_choice": "required"},  # no tools
        {"functions": [{"name": "f"}]},  # the legacy form
    ]
    for fields in bad:
        resp = await post(url, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                                        **fields})
        assert resp.status_code == 400, (fields, resp.text)
        assert resp.json()["error"]["message"]
    resp = await post(url, "/v1/messages", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                                            "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert resp.status_code == 400 and "server tools" in resp.json()["error"]["message"]
