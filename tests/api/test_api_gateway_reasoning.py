"""A reasoning model's thinking through the gateway, with the official ``openai`` SDK: ``reasoning_content`` in
the message and in the stream's deltas, apart from ``content``; ``chat_template_kwargs.enable_thinking`` off
leaves none. A real gateway, Redis and worker process on a generated model with think markers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.gateway_support import Deployment, ServedGateway, deployment
from tests.worker.test_worker_reasoning import thought_then_answer

MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def served(tiny_think_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_think_model, tmp_path_factory.mktemp("gw-reasoning")) as running:
        yield running


@pytest.fixture
async def oai(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0) as c:
        yield c


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
