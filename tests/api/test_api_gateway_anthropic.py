"""The gateway's Anthropic Messages API, with the official ``anthropic`` SDK as the client: a real gateway, a
real Redis and a real worker process on the tiny model. Greedy text through the gateway equals
``Client.generate``'s for the same request; a client that goes away cancels its job."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import pytest

from mlxq.api.client import Client
from mlxq.api.follow import Result
from mlxq.api.schema import DoneEvent, FinishReason
from tests.api.gateway_support import Deployment, ServedGateway, deployment

pytestmark = pytest.mark.e2e

SYSTEM = "Answer briefly."
USER = [{"role": "user", "content": "Say hello"}]
AS_QUEUE = [{"role": "system", "content": SYSTEM}, *USER]  # the same conversation, as a queue job


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-anthropic")) as running:
        yield running


@pytest.fixture
async def queue(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[Client]:
    async with Client(config=served[0].config.client) as c:
        yield c


def stop_reason(result: Result) -> str:
    return "max_tokens" if result.finish_reason is FinishReason.LENGTH else "end_turn"


async def test_a_message_is_the_queues_greedy_text(claude: anthropic.AsyncAnthropic, queue: Client) -> None:
    msg = await claude.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=24)  # type: ignore[arg-type]
    want = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=24, timeout=60)
    assert want.text and [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", want.text)]
    assert msg.stop_reason == stop_reason(want) and msg.role == "assistant" and msg.type == "message"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert msg.id.startswith("msg_") and msg.model == "tiny"


async def test_a_streamed_message_sends_anthropics_events_and_the_same_text(
        claude: anthropic.AsyncAnthropic, queue: Client) -> None:
    stream = await claude.messages.create(model="tiny", system=SYSTEM, messages=USER,  # type: ignore[arg-type]
                                          max_tokens=40, stream=True)
    events = [ev async for ev in stream]
    want = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=40, timeout=60)
    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(ev.delta.text for ev in events if ev.type == "content_block_delta"  # type: ignore[union-attr]
                   and ev.delta.type == "text_delta") == want.text
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and start.message.usage.input_tokens == want.usage.prompt_tokens
    assert delta.type == "message_delta" and delta.delta.stop_reason == stop_reason(want)
    assert delta.usage.output_tokens == want.usage.completion_tokens == 40


async def test_the_sdks_stream_helper_assembles_the_final_message(claude: anthropic.AsyncAnthropic,
                                                                  queue: Client) -> None:
    async with claude.messages.stream(model="tiny", system=SYSTEM, messages=USER, max_tokens=16) as stream:  # type: ignore[arg-type]
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    want = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=16, timeout=60)
    assert "".join(texts) == want.text == final.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == 16


async def test_system_blocks_text_blocks_and_stop_sequences(claude: anthropic.AsyncAnthropic, queue: Client) -> None:
    greedy = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=40, timeout=60)
    stop = greedy.text[10:14]
    msg = await claude.messages.create(
        model="tiny", max_tokens=40, stop_sequences=[stop], system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}],
    )
    assert msg.content[0].text == greedy.text[: greedy.text.index(stop)]  # type: ignore[union-attr]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)


async def test_a_stream_a_stop_sequence_ends_says_which(claude: anthropic.AsyncAnthropic, queue: Client) -> None:
    greedy = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=40, timeout=60)
    stop = greedy.text[12:15]
    async with claude.messages.stream(model="tiny", system=SYSTEM, messages=USER, max_tokens=40,  # type: ignore[arg-type]
                                      stop_sequences=["never in this text", stop]) as stream:
        events = [ev async for ev in stream]
        final = await stream.get_final_message()
    (delta,) = [ev for ev in events if ev.type == "message_delta"]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", stop)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == greedy.text[: greedy.text.index(stop)]  # type: ignore[union-attr]


async def test_a_message_that_ends_otherwise_names_no_stop_sequence(claude: anthropic.AsyncAnthropic) -> None:
    msg = await claude.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=8,  # type: ignore[arg-type]
                                       stop_sequences=["never in this text"])
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)


async def test_temperature_top_p_and_top_k_are_mapped(claude: anthropic.AsyncAnthropic, queue: Client) -> None:
    # Unseeded sampling differs run to run; what holds is that it is not the greedy text every time. (This SDK
    # release dropped these fields from its signature; the API still takes them.)
    greedy = await queue.generate(model="tiny", messages=AS_QUEUE, max_tokens=20, timeout=60)
    texts = set()
    for _ in range(3):
        msg = await claude.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=20,  # type: ignore[arg-type]
                                           extra_body={"temperature": 1.0, "top_p": 0.95, "top_k": 100})
        texts.add(msg.content[0].text)  # type: ignore[union-attr]
    assert texts - {greedy.text}


async def test_a_client_that_leaves_a_stream_cancels_its_job(claude: anthropic.AsyncAnthropic,
                                                             queue: Client) -> None:
    stream = await claude.messages.create(model="tiny", system=SYSTEM, messages=USER,  # type: ignore[arg-type]
                                          max_tokens=400, stream=True)
    rid = ""
    async for ev in stream:
        if ev.type == "message_start":
            rid = ev.message.id.removeprefix("msg_")
        if ev.type == "content_block_delta":
            break
    await stream.close()
    events = [ev async for ev in queue.events(rid, timeout=30)]
    end = events[-1]
    assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
    assert end.usage.completion_tokens < 400
