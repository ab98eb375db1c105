"""OpenAI's Responses API through the gateway, with the official ``openai`` SDK as the client: a real gateway
(uvicorn), a real Redis and a real worker process on the tiny model (and on ``tiny-tools`` for function calls).
A response's greedy text equals the same request's through chat completions; stored responses are retrieved,
resumed, cancelled, continued and deleted through any gateway, and only by their tenant's keys."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlxq.api.client import Client
from mlxq.worker.tools.process import GatewayProcess
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, deployment
from tests.worker.test_worker_tools import WEATHER, valid

pytestmark = pytest.mark.e2e

LONG = 400  # tokens: a job still decoding long after it started (the context is 512)


class Ticket(BaseModel):  # bounded, so the random-weight model's JSON ends (status completed)
    model_config = ConfigDict(extra="forbid")

    title: str = Field(max_length=10)
    score: int = Field(ge=0, le=10)
    open: bool


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-responses")) as running:
        yield running


def status_of(finish: str | None) -> str:
    return {"stop": "completed", "length": "incomplete", "tool_calls": "completed"}[finish or "stop"]


async def ended(oai: openai.AsyncOpenAI, rid: str) -> Any:
    """The response once it left queued and in_progress (polled, as a client of background mode polls)."""
    for _ in range(600):
        resp = await oai.responses.retrieve(rid)
        if resp.status not in ("queued", "in_progress"):
            return resp
        await asyncio.sleep(0.1)
    raise AssertionError(f"{rid} never ended")


def texts(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


# --- create ---------------------------------------------------------------------------------------------
async def test_a_response_is_the_chat_completions_greedy_text_and_is_stored(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.responses.create(model="tiny", input="Say hello", instructions="Answer briefly.",
                                      max_output_tokens=24)
    chat = await oai.chat.completions.create(model="tiny", max_tokens=24, messages=[  # type: ignore[arg-type]
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello"}])
    (choice,) = chat.choices
    assert resp.output_text and resp.output_text == choice.message.content
    assert resp.status == status_of(choice.finish_reason) and resp.object == "response" and resp.id.startswith("resp_")
    if resp.status == "incomplete":
        assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert resp.usage is not None and chat.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens == 0 and resp.usage.output_tokens_details.reasoning_tokens == 0
    again = await oai.responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump()
    items = await oai.responses.input_items.list(resp.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Say hello"  # type: ignore[union-attr]


async def test_a_prompt_whose_start_the_worker_cached_reports_its_cached_tokens_in_both_apis(
        oai: openai.AsyncOpenAI) -> None:
    system = "You sort questions about the queue, its workers and the prompts their prefix caches keep. " * 6
    first = await oai.responses.create(model="tiny", instructions=system, input="What is a queue?",
                                       max_output_tokens=4)
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0  # its first sight
    second = await oai.responses.create(model="tiny", instructions=system, input="Why batch the tokens?",
                                        max_output_tokens=4)
    chat = await oai.chat.completions.create(model="tiny", max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "And the cache?"}])
    assert second.usage is not None and chat.usage is not None and chat.usage.prompt_tokens_details is not None
    # The system prompt's tokens came from the worker's prefix cache; the question's were prefilled.
    assert 64 <= second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    assert 64 <= (chat.usage.prompt_tokens_details.cached_tokens or 0) < chat.usage.prompt_tokens


async def test_a_streamed_response_is_openais_events_in_order_and_the_sdks_accumulator_takes_them(
        oai: openai.AsyncOpenAI) -> None:
    async with oai.responses.stream(model="tiny", input="File a ticket", text_format=Ticket,
                                    max_output_tokens=200) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert final.status == "completed" and isinstance(final.output_parsed, Ticket)
    parsed = await oai.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "File a ticket"}],
                                              response_format=Ticket, max_tokens=200)
    assert texts(events) == final.output_text == parsed.choices[0].message.content  # greedy: the same JSON
    assert (await oai.responses.retrieve(final.id)).output_text == final.output_text


# --- background -----------------------------------------------------------------------------------------
async def test_a_background_response_is_polled_to_its_end_and_its_stream_replays_alike(
        oai: openai.AsyncOpenAI) -> None:
    bg = await oai.responses.create(model="tiny", input="Count:", background=True, max_output_tokens=48)
    assert bg.background and bg.status == "queued" and bg.output == []
    done = await ended(oai, bg.id)
    assert done.status == "incomplete" and done.output_text
    whole = [e async for e in await oai.responses.retrieve(bg.id, stream=True)]
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert [e.type for e in whole[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert whole[-1].type == "response.incomplete" and texts(whole) == done.output_text
    tail = [e async for e in await oai.responses.retrieve(bg.id, stream=True, starting_after=5)]
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in whole[6:]]
    # The SDK's resume helper asks for the whole stream and drops what it had.
    async with oai.responses.stream(response_id=bg.id, starting_after=5) as resumed:
        again = [e async for e in resumed]
    assert [e.sequence_number for e in again] == list(range(6, len(whole)))


async def test_a_background_stream_left_midway_resumes_after_its_last_event(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.responses.create(model="tiny", input="Count:", background=True, stream=True,
                                        max_output_tokens=120)
    first = []
    async for event in stream:
        first.append(event)
        if event.type == "response.output_text.delta" and len(first) > 8:
            break
    await stream.close()  # a background response runs on without its stream
    rid = first[0].response.id  # type: ignore[union-attr]
    rest = [e async for e in await oai.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number)]
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    done = await oai.responses.retrieve(rid)
    assert rest[-1].type == "response.incomplete" and texts(first + rest) == done.output_text


async def test_a_background_response_is_cancelled_and_only_it(oai: openai.AsyncOpenAI) -> None:
    bg = await oai.responses.create(model="tiny", input="Count:", background=True, max_output_tokens=LONG)
    cancelled = await oai.responses.cancel(bg.id)
    assert cancelled.status == "cancelled" and (await oai.responses.retrieve(bg.id)).status == "cancelled"
    plain = await oai.responses.create(model="tiny", input="Count:", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        await oai.responses.cancel(plain.id)


# --- conversations --------------------------------------------------------------------------------------
async def test_a_chain_of_three_turns_is_the_chat_of_their_messages(oai: openai.AsyncOpenAI) -> None:
    r1 = await oai.responses.create(model="tiny", input="My name is Ann.", instructions="Answer briefly.",
                                    max_output_tokens=8)
    r2 = await oai.responses.create(model="tiny", input="What is my name?", previous_response_id=r1.id,
                                    max_output_tokens=8)
    r3 = await oai.responses.create(model="tiny", input="Spell it.", previous_response_id=r2.id,
                                    instructions="Be terse.", max_output_tokens=8)
    # r1's instructions are not carried over; r3's come first.
    messages: Any = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "My name is Ann."},
                     {"role": "assistant", "content": r1.output_text},
                     {"role": "user", "content": "What is my name?"},
                     {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Spell it."}]
    chat = await oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert r3.output_text and r3.output_text == chat.choices[0].message.content
    assert r3.previous_response_id == r2.id and r3.instructions == "Be terse."


# --- refusals and tenants -------------------------------------------------------------------------------
async def test_unknown_ids_unsupported_input_and_other_tenants_are_refused_as_openai_does(
        served: tuple[Deployment, ServedGateway], oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.responses.retrieve("resp_0123")
    assert missing.value.body == {"message": "Response with id 'resp_0123' not found.",  # type: ignore[comparison-overlap]
                                  "type": "invalid_request_error", "param": "response_id", "code": None}
    with pytest.raises(openai.NotFoundError) as chained:
        await oai.responses.create(model="tiny", input="hi", previous_response_id="resp_0123")
    assert chained.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="background"):
        await oai.responses.create(model="tiny", input="hi", store=False, background=True)
    with pytest.raises(openai.BadRequestError, match="'file_search_call'"):
        await oai.responses.create(model="tiny", input=[{"type": "file_search_call", "id": "fs", "queries": [],
                                                         "status": "completed"}])
    with pytest.raises(openai.BadRequestError, match="'web_search'"):
        await oai.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    for stream in (False, True):  # a job the worker refuses: 400 before any stream starts, as chat's
        with pytest.raises(openai.BadRequestError, match=r"exceeds the context"):
            await oai.responses.create(model="tiny", input="hi", max_output_tokens=512, stream=stream)
    unstored = await oai.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unstored.id)
    with served[0].gateway(api_keys=frozenset({"ka=alice", "kb=bob"})) as keyed:
        async with openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key="ka", max_retries=0) as alice, \
                openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key="kb", max_retries=0) as bob:
            mine = await alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.create(model="tiny", input="hi", previous_response_id=mine.id)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.delete(mine.id)
            assert (await alice.responses.retrieve(mine.id)).id == mine.id
            async with httpx.AsyncClient(base_url=keyed.url, headers={"authorization": "Bearer ka"}) as http:
                deleted = await http.delete(f"/v1/responses/{mine.id}")
            assert deleted.json() == {"id": mine.id, "object": "response.deleted", "deleted": True}
            with pytest.raises(openai.NotFoundError):
                await alice.responses.retrieve(mine.id)


# --- a gateway restart ----------------------------------------------------------------------------------
@pytest.mark.slow
async def test_a_background_response_outlives_the_gateway_that_created_it(
        served: tuple[Deployment, ServedGateway], oai: openai.AsyncOpenAI, tmp_path: Path) -> None:
    env = {"MLXQ_REDIS_URL": served[0].redis.url, "MLXQ_PREFIX": PREFIX}
    first = GatewayProcess(env, tmp_path / "gateway-1.log").start()
    try:
        await asyncio.to_thread(first.wait_ready)
        async with openai.AsyncOpenAI(base_url=f"{first.url}/v1", api_key="unused", max_retries=0) as there:
            bg = await there.responses.create(model="tiny", input="Count:", background=True, max_output_tokens=200)
    finally:
        assert first.proc is not None
        first.proc.kill()  # no shutdown: whatever it held in memory is gone
        first.proc.wait()
    second = GatewayProcess(env, tmp_path / "gateway-2.log").start()
    try:
        await asyncio.to_thread(second.wait_ready)
        async with openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0) as here:
            done = await ended(here, bg.id)
            replayed = [e.model_dump() async for e in await here.responses.retrieve(bg.id, stream=True)]
    finally:
        second.stop()
    chat = await oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count:"}],
                                             max_tokens=200)
    assert done.status == "incomplete" and done.output_text == chat.choices[0].message.content
    assert (await oai.responses.retrieve(bg.id)).model_dump() == done.model_dump()  # recorded once, the same
    assert [e.model_dump() async for e in await oai.responses.retrieve(bg.id, stream=True)] == replayed


@pytest.mark.slow
async def test_a_background_response_whose_worker_dies_ends_once_with_the_rerun(
        served: tuple[Deployment, ServedGateway], oai: openai.AsyncOpenAI) -> None:
    deployment_ = served[0]
    bg = await oai.responses.create(model="tiny", input="Count:", background=True, max_output_tokens=LONG)
    while not (now := await oai.responses.retrieve(bg.id)).output_text:  # started, and some text made
        assert now.status in ("queued", "in_progress")
        await asyncio.sleep(0.05)
    for worker in deployment_.workers:
        worker.kill()  # its lease lapses; the next worker runs the job again
    deployment_.worker("tiny")
    done = await ended(oai, bg.id)
    chat = await oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count:"}],
                                             max_tokens=LONG)
    assert done.status == "incomplete" and done.output_text == chat.choices[0].message.content
    assert done.output_text.startswith(now.output_text)  # greedy: the re-run repeats what was made
    events = [e async for e in await oai.responses.retrieve(bg.id, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert texts(events) == done.output_text and [e.type for e in events].count("response.in_progress") == 1
    async with Client(config=deployment_.config.client) as queue:  # it did run twice
        assert [ev.type async for ev in queue.events(bg.id.removeprefix("resp_"), timeout=30)].count("reset") == 1


# --- function calls (tiny-tools) ------------------------------------------------------------------------
FUNCTION: Any = WEATHER["function"]
FLAT_WEATHER: Any = {"type": "function", **FUNCTION}


@pytest.fixture(scope="module")
def tools_served(tiny_tools_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_tools_model, tmp_path_factory.mktemp("gw-responses-tools")) as running:
        yield running


@pytest.fixture
async def tools_oai(tools_served: tuple[Deployment, ServedGateway]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{tools_served[1].url}/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_a_function_call_round_trip_is_the_chat_tool_loop(tools_oai: openai.AsyncOpenAI) -> None:
    ask = "What is the weather in Paris?"
    async with tools_oai.responses.stream(model="tiny", input=ask, tools=[FLAT_WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=400) as stream:
        events = [e async for e in stream]
        r1 = await stream.get_final_response()
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and valid(call.name, json.loads(call.arguments), [WEATHER])
    kinds = [e.type for e in events]
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    r2 = await tools_oai.responses.create(model="tiny", input=[result], previous_response_id=r1.id,  # type: ignore[list-item]
                                          tools=[FLAT_WEATHER], max_output_tokens=16)
    # The same turns sent whole, as items, and as chat messages: the same greedy text.
    replayed = await tools_oai.responses.create(model="tiny", tools=[FLAT_WEATHER], max_output_tokens=16, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result])  # type: ignore[list-item]
    tools: Any = [WEATHER]
    chat = await tools_oai.chat.completions.create(model="tiny", tools=tools, max_tokens=16, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": '{"temp": 21}'}])  # type: ignore[arg-type,list-item]
    message = chat.choices[0].message
    assert r2.output_text == replayed.output_text == (message.content or "")
    assert len([o for o in r2.output if o.type == "function_call"]) == len(message.tool_calls or [])
