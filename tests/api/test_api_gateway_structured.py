"""Structured output through the whole queue: the ``openai`` SDK's ``chat.completions.parse`` against a real
gateway, Redis and worker process on the random-weight tiny model, and the same through ``Client``. What the
model writes under a schema always parses and validates, whatever its weights."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from enum import Enum
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest
from mlxq.api.schema import ErrorEvent
from tests.api.gateway_support import Deployment, ServedGateway, deployment

pytestmark = pytest.mark.e2e


class Size(str, Enum):
    SMALL = "small"
    LARGE = "large"


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say

    name: str = Field(max_length=8)
    qty: int = Field(ge=1, le=20)


class Ticket(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say

    title: str = Field(max_length=10)
    size: Size
    items: list[Item] = Field(max_length=2)
    score: int = Field(ge=0, le=10)
    open: bool


class OpenItem(BaseModel):  # Item's fields, and a schema that leaves additionalProperties unspecified
    name: str = Field(max_length=8)
    qty: int = Field(ge=1, le=20)


class OpenTicket(BaseModel):
    title: str = Field(max_length=10)
    size: Size
    items: list[OpenItem] = Field(max_length=2)
    score: int = Field(ge=0, le=10)
    open: bool


MESSAGES = [{"role": "user", "content": "File a ticket for the queue"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-structured")) as running:
        yield running


@pytest.fixture
async def queue(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[Client]:
    async with Client(config=served[0].config.client) as c:
        yield c


async def test_the_sdks_parse_returns_the_pydantic_object(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Ticket,  # type: ignore[arg-type]
                                            max_tokens=200)
    (choice,) = resp.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Ticket)
    assert Ticket.model_validate_json(choice.message.content or "") == choice.message.parsed


async def test_a_streamed_structured_completion_is_the_same_json(oai: openai.AsyncOpenAI, queue: Client) -> None:
    async with oai.chat.completions.stream(model="tiny", messages=MESSAGES, response_format=Ticket,  # type: ignore[arg-type]
                                           max_tokens=200) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Ticket)
    whole = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=200, response_format=SCHEMA, timeout=60)
    assert Ticket.model_validate_json(whole.text) == parsed  # greedy under a schema: the same through both


async def test_a_schema_that_leaves_additional_properties_unspecified_gets_only_its_keys(
        oai: openai.AsyncOpenAI) -> None:
    # A model's plain model_json_schema(): without additionalProperties: false a random-weight model opened a key
    # the schema never named and wrote it until max_tokens.
    schema = OpenTicket.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "OpenTicket", "schema": schema}}
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400,  # type: ignore[call-overload]
                                               temperature=0, response_format=fmt, stream=True)
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop", text
    Ticket.model_validate_json(text)  # Ticket forbids keys it does not name, at every level


async def test_json_mode_gives_a_json_object(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                                             response_format={"type": "json_object"})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    else:
        assert (resp.choices[0].message.content or "").startswith("{")


async def test_concurrent_constrained_and_free_requests_are_all_valid(queue: Client) -> None:
    async def one(i: int) -> tuple[int, str, str]:
        fmt = {"response_format": SCHEMA} if i % 2 else {}
        r = await queue.generate(model="tiny", messages=[{"role": "user", "content": f"ticket {i}"}],
                                 max_tokens=200, timeout=120, **fmt)
        return i, r.text, r.finish_reason.value

    results = await asyncio.gather(*(one(i) for i in range(32)))
    for i, text, reason in results:
        if i % 2:
            assert reason == "stop"
            Ticket.model_validate_json(text)


async def test_a_schema_that_cannot_compile_ends_the_job_with_bad_request(queue: Client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    rid = await queue.submit(model="tiny", prompt="x", max_tokens=8, response_format=bad)
    events = [ev async for ev in queue.events(rid, timeout=30)]
    assert isinstance(events[-1], ErrorEvent) and events[-1].code.value == "bad_request"
    assert "json_schema" in events[-1].message


async def test_a_malformed_response_format_is_refused_before_it_is_queued(queue: Client,
                                                                          oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(BadRequest):
        await queue.submit(model="tiny", prompt="x", response_format={"type": "json_schema", "json_schema": {}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        await oai.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                          response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                          response_format={"type": "xml"})
