"""A reasoning model's thinking through the gateway, with the official SDKs: OpenAI's ``reasoning_content`` in
the message and in the stream's deltas, apart from ``content`` (``chat_template_kwargs.enable_thinking`` off
leaves none); Anthropic's thinking block before the text block, whole and streamed. A real gateway, Redis and
worker process on a generated model with think markers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from mlxq.api.client import Client
from tests.api.gateway_support import Deployment, ServedGateway, deployment
from tests.worker.test_worker_reasoning import thought_then_answer

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def served(tiny_think_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_think_model, tmp_path_factory.mktemp("gw-reasoning")) as running:
        yield running


async def test_thinking_is_reasoning_content_apart_from_the_content(oai: openai.AsyncOpenAI,
                                                                    tiny_think_model: Path) -> None:
    fmt: Any = thought_then_answer(tiny_think_model)
    whole = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                              response_format=fmt)
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning and message.content and "think>" not in reasoning + message.content
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                               response_format=fmt, stream=True)
    chunks = [c async for c in stream]
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed, content) == (reasoning, message.content)


async def test_thinking_switched_off_leaves_no_reasoning(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = resp.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {}) and message.content
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                          extra_body={"chat_template_kwargs": {"tools_in_user": True}})


async def test_thinking_is_a_thinking_block_before_the_text_whole_and_streamed(
        claude: anthropic.AsyncAnthropic, served: tuple[Deployment, ServedGateway]) -> None:
    # The template opens the think block and the random weights never close it: all of it is thinking.
    async with Client(config=served[0].config.client) as queue:
        want = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=24, reasoning="split",
                                    enable_thinking=True, timeout=60)
    whole = await claude.messages.create(model="tiny", max_tokens=24, messages=MESSAGES,  # type: ignore[arg-type]
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = whole.content
    assert thinking.type == "thinking" and thinking.thinking == want.reasoning and want.reasoning
    assert text.type == "text" and text.text == want.text
    async with claude.messages.stream(model="tiny", max_tokens=24, messages=MESSAGES,  # type: ignore[arg-type]
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"


async def test_thinking_is_a_reasoning_item_before_the_message_of_a_response(oai: openai.AsyncOpenAI,
                                                                              tiny_think_model: Path) -> None:
    fmt: Any = thought_then_answer(tiny_think_model)
    chat = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                             response_format=fmt)
    message = chat.choices[0].message
    async with oai.responses.stream(model="tiny", input=MESSAGES, max_output_tokens=40,  # type: ignore[arg-type]
                                    extra_body={"text": {"format": fmt}}) as stream:
        kinds = [e.type async for e in stream]
        resp = await stream.get_final_response()
    reasoning, answer = resp.output
    assert reasoning.type == "reasoning" and answer.type == "message"
    assert reasoning.content is not None and reasoning.content[0].text == (message.model_extra or {}).get(
        "reasoning_content")
    assert resp.output_text == message.content and kinds.index("response.reasoning_text.delta") < kinds.index(
        "response.output_text.delta")
    assert resp.usage is not None and 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens

