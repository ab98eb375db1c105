"""Reasoning apart from the answer, through the queue: a real Redis and worker on a generated model whose
tokenizer has think markers and whose template opens a think block. The random weights write what a regex
constrains them to, so the output holds a think block's end where the test wants one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from tests.support import config_with, start_worker

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Think, then answer."}]


def thought_then_answer(model: Path) -> dict[str, str]:
    """A grammar for a few letters, the think block's end (its token: llguidance takes an added token by id, not
    as text), and a few letters."""
    from mlx_lm.utils import load_tokenizer

    (end,) = load_tokenizer(model).think_end_tokens
    return {"type": "grammar", "grammar": f"start: /[a-z]{{3,8}}/ <[{end}]> /[a-z]{{3,8}}/"}


async def test_reasoning_goes_apart_from_the_answer_when_asked(worker_config: Any, tiny_think_model: Path,
                                                               client: Client) -> None:
    running = await start_worker(config_with(worker_config, model=str(tiny_think_model), model_name="think"))
    try:
        ask = {"model": "think", "messages": MESSAGES, "max_tokens": 40,
               "response_format": thought_then_answer(tiny_think_model), "timeout": 60}
        inline = await client.generate(**ask)
        split = await client.generate(**ask, reasoning="split")
        assert inline.reasoning == "" and "</think>" in inline.text  # one text, as a client of before reads it
        assert split.reasoning and split.text and "think>" not in split.text + split.reasoning
        assert inline.text == split.reasoning + "</think>" + split.text and inline.token_ids == split.token_ids
        rid = await client.submit(**{k: v for k, v in ask.items() if k != "timeout"}, reasoning="split")
        events = [ev async for ev in client.events(rid, timeout=60)]
        tokens = [ev for ev in events if ev.type == "token"]
        assert "".join(ev.reasoning for ev in tokens) == split.reasoning
        assert "".join(ev.text for ev in tokens) == split.text
        streamed = "".join([piece async for piece in client.stream(**ask, reasoning="split")])
        assert streamed == split.text  # stream_text is the answer's text

        # Thinking off: the template closes the think block in the prompt; everything written is the answer.
        plain = {"type": "regex", "regex": "[a-z]{3,8}"}
        off = await client.generate(model="think", messages=MESSAGES, max_tokens=10, response_format=plain,
                                    reasoning="split", enable_thinking=False, timeout=60)
        assert off.reasoning == "" and off.text.isalpha()
    finally:
        await running.close()


async def test_a_model_without_think_markers_has_no_reasoning(worker: Any, client: Client) -> None:
    split = await client.generate(model="tiny", prompt="Hello", max_tokens=12, reasoning="split", timeout=60)
    inline = await client.generate(model="tiny", prompt="Hello", max_tokens=12, timeout=60)
    assert split.reasoning == "" and split.text == inline.text


async def test_logprobs_come_with_each_token_through_the_queue(worker: Any, client: Client) -> None:
    from tests.engine.test_engine_logprobs import reference

    model = worker.service.model
    result = await client.generate(model="tiny", prompt="Hello there", max_tokens=12, logprobs=3, timeout=60)
    assert result.logprobs is not None and [lp.token for lp in result.logprobs] == result.token_ids
    prompt = model.prompts.encode("Hello there", None)
    want = await worker.service.engine.thread.call(reference, model.model, prompt, 12)
    for got, (token, vector) in zip(result.logprobs, want):
        assert got.token == token and abs(got.logprob - vector[token]) < 1e-3
        assert got.text == model.tokenizer.decode([token])
        assert len(got.top) == 3 and got.top[0].token == token and got.top[0].text == got.text
        assert [t.logprob for t in got.top] == sorted((t.logprob for t in got.top), reverse=True)
    plain = await client.generate(model="tiny", prompt="Hello there", max_tokens=12, timeout=60)
    assert plain.logprobs is None and plain.token_ids == result.token_ids
