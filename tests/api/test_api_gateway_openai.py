"""The gateway's OpenAI API, with the official ``openai`` SDK as the client: a real gateway (uvicorn), a real
Redis and a real worker process on the tiny model. Greedy text through the gateway equals ``Client.generate``'s
for the same request; a client that goes away cancels its job."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxq.api.client import Client
from mlxq.api.follow import Result
from mlxq.api.schema import DoneEvent, Event, FinishReason
from mlxq.worker.tools.process import GatewayProcess
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, deployment

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello"}]
LONG = 400  # tokens: a job still decoding long after its first chunk (the context is 512)


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-openai")) as running:
        yield running


@pytest.fixture
async def queue(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[Client]:
    async with Client(config=served[0].config.client) as c:
        yield c


def finish(result: Result) -> str:
    return "length" if result.finish_reason is FinishReason.LENGTH else "stop"


async def terminal(queue: Client, rid: str) -> Event:
    events = [ev async for ev in queue.events(rid, timeout=30)]
    return events[-1]


# --- chat completions -------------------------------------------------------------------------------
async def test_a_chat_completion_is_the_queues_greedy_text(oai: openai.AsyncOpenAI, queue: Client) -> None:
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24)  # type: ignore[arg-type]
    want = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=24, timeout=60)
    (choice,) = resp.choices
    assert want.text and choice.message.content == want.text and choice.message.role == "assistant"
    assert choice.finish_reason == finish(want)
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                       want.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("chatcmpl-") and resp.model == "tiny" and resp.object == "chat.completion"


async def test_a_streamed_chat_completion_sends_the_same_text_a_finish_reason_then_usage(
        oai: openai.AsyncOpenAI, queue: Client) -> None:
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                               stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    want = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=40, timeout=60)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish(want)]
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 40
    assert all(c.usage is None for c in body)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


async def test_without_include_usage_a_stream_has_no_usage_chunk(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                               stream=True)
    chunks = [c async for c in stream]
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_without_max_tokens_a_request_gets_what_fits_the_context(oai: openai.AsyncOpenAI) -> None:
    # The gateway's default (512) is the tiny model's whole context: the worker lowers it to what the prompt leaves.
    chat = await oai.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
    text = await oai.completions.create(model="tiny", prompt="Once upon a time")
    for resp, reason in ((chat, chat.choices[0].finish_reason), (text, text.choices[0].finish_reason)):
        assert resp.usage is not None and reason == "length"
        assert resp.usage.prompt_tokens + resp.usage.completion_tokens == 512
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(512\) exceeds the context \(512\)"):
        await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=512)  # type: ignore[arg-type]


async def test_content_parts_of_text_are_joined(oai: openai.AsyncOpenAI, queue: Client) -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]
    resp = await oai.chat.completions.create(model="tiny", max_tokens=16,  # type: ignore[misc]
                                             messages=[MESSAGES[0], {"role": "user", "content": parts}])
    want = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=16, timeout=60)
    assert resp.choices[0].message.content == want.text


async def test_sampling_fields_reach_the_job(oai: openai.AsyncOpenAI, queue: Client) -> None:
    # A seeded sampler repeats itself: the same fields through the gateway and through the client agree, and
    # differ from greedy text.
    fields: dict[str, Any] = {"temperature": 0.9, "top_p": 0.9, "seed": 7, "presence_penalty": 0.5,
                              "frequency_penalty": 0.3}
    extensions = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30,  # type: ignore[arg-type]
                                             extra_body=extensions, **fields)
    sampled = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=30, timeout=60, **fields, **extensions)
    greedy = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=30, timeout=60)
    assert resp.choices[0].message.content == sampled.text != greedy.text


async def test_a_stop_string_cuts_the_text_before_it(oai: openai.AsyncOpenAI, queue: Client) -> None:
    greedy = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=40, timeout=60)
    stop = greedy.text[12:16]
    resp = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
                                             stop=stop)
    assert resp.choices[0].message.content == greedy.text[: greedy.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


# --- completions ------------------------------------------------------------------------------------
async def test_a_completion_is_the_queues_greedy_text_streamed_or_not(oai: openai.AsyncOpenAI, queue: Client) -> None:
    want = await queue.generate(model="tiny", prompt="Once upon a time", max_tokens=32, timeout=60)
    whole = await oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=32)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == finish(want)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage is not None and whole.usage.prompt_tokens == want.usage.prompt_tokens
    stream = await oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=32, stream=True,
                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish(want)]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == want.usage.completion_tokens


# --- a client that goes away ------------------------------------------------------------------------
async def test_a_client_that_leaves_a_stream_cancels_its_job(oai: openai.AsyncOpenAI, queue: Client) -> None:
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=LONG,  # type: ignore[arg-type]
                                               stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    end = await terminal(queue, chunk.id.removeprefix("chatcmpl-"))
    assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
    assert end.usage.completion_tokens < LONG


async def test_a_client_that_leaves_before_a_whole_response_cancels_its_job(
        served: tuple[Deployment, ServedGateway], queue: Client) -> None:
    d, gw = served
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": LONG}
    before = await job_logs(d, queue)
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        waiting = asyncio.create_task(http.post("/v1/completions", json=body))
        rid = await running_job(d, queue, before)
        waiting.cancel()  # the connection closes under the request
        await asyncio.gather(waiting, return_exceptions=True)
    end = await terminal(queue, rid)
    assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
    assert end.usage.completion_tokens < LONG


async def job_logs(d: Deployment, queue: Client) -> set[str]:
    """The replay logs in Redis now: one per job that started in the last few minutes."""
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(d.redis.url)
    try:
        return {k.decode() async for k in r.scan_iter(match=queue.keys.log("*"))}
    finally:
        await r.aclose()


async def running_job(d: Deployment, queue: Client, before: set[str]) -> str:
    """The id of the one job started since ``before`` was taken, once it has made a token."""
    for _ in range(500):
        new = await job_logs(d, queue) - before
        if new:
            break
        await asyncio.sleep(0.01)
    (log,) = new
    rid = log[log.index("{") + 1 : log.index("}")]
    async for ev in queue.events(rid, timeout=30):
        if ev.type == "token":
            return rid
    raise AssertionError(f"job {rid} ended before making a token")


# --- several gateways -------------------------------------------------------------------------------
async def test_two_gateway_processes_serve_one_queue_side_by_side(served: tuple[Deployment, ServedGateway],
                                                                  queue: Client, tmp_path: Path) -> None:
    # Two `mlxq gateway` processes, each with its own queue client, in front of the same Redis and worker: the
    # requests of both, all in flight at once, each get their own job's greedy text.
    env = {"MLXQ_REDIS_URL": served[0].redis.url, "MLXQ_PREFIX": PREFIX}
    gateways = [GatewayProcess(env, tmp_path / f"gateway-{i}.log").start() for i in range(2)]
    try:
        await asyncio.gather(*(asyncio.to_thread(g.wait_ready) for g in gateways))
        prompts = [f"Count to {k}:" for k in range(8)]
        wants = await asyncio.gather(*(queue.generate(model="tiny", prompt=p, max_tokens=12, timeout=60)
                                       for p in prompts))
        async with contextlib.AsyncExitStack() as stack:
            sdks = [await stack.enter_async_context(openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="unused",
                                                                       max_retries=0)) for g in gateways]
            got = await asyncio.gather(*(_completion(sdks[k % 2], p, stream=k % 4 < 2) for k, p in enumerate(prompts)))
        assert got == [w.text for w in wants] and all(got)
        assert all(g.proc is not None and g.proc.poll() is None for g in gateways)
    finally:
        ended = [g.stop() for g in gateways]
    assert all(status in (0, -signal.SIGTERM) for status in ended)  # uvicorn re-raises the SIGTERM it handled


async def _completion(sdk: openai.AsyncOpenAI, prompt: str, *, stream: bool) -> str:
    if not stream:
        resp = await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12)
        return resp.choices[0].text
    chunks = await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True)
    return "".join([c.choices[0].text async for c in chunks if c.choices])


async def test_a_gateway_shutting_down_ends_its_open_streams_and_cancels_their_jobs(
        served: tuple[Deployment, ServedGateway], queue: Client, tmp_path: Path) -> None:
    gateway = GatewayProcess({"MLXQ_REDIS_URL": served[0].redis.url, "MLXQ_PREFIX": PREFIX},
                             tmp_path / "gateway.log").start()
    try:
        await asyncio.to_thread(gateway.wait_ready)
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as oai:
            stream = await oai.completions.create(model="tiny", prompt="Count:", max_tokens=LONG, stream=True)
            first = await anext(aiter(stream))
            assert gateway.proc is not None
            gateway.proc.send_signal(signal.SIGTERM)  # the stream ends now, not when its job would
            with contextlib.suppress(openai.APIError, httpx.HTTPError):
                rest = [chunk async for chunk in stream]
                assert not any(c.choices and c.choices[0].finish_reason for c in rest)  # it was cut short
    finally:
        status = gateway.stop()
    end = await terminal(queue, first.id.removeprefix("cmpl-"))
    assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
    # Cancelled short of its end: the stream was ended at the SIGTERM (waiting out the server's graceful period,
    # the job would have had the time to finish).
    assert end.usage.completion_tokens < LONG and status in (0, -signal.SIGTERM)


async def test_logprobs_are_each_tokens_text_logprob_and_top_alternatives(oai: openai.AsyncOpenAI,
                                                                          queue: Client) -> None:
    whole = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                             logprobs=True, top_logprobs=3)
    want = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=12, logprobs=3, timeout=60)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert want.logprobs is not None and len(content) == len(want.logprobs) == 12
    for got, lp in zip(content, want.logprobs):
        assert (got.token, got.logprob, got.bytes) == (lp.text, lp.logprob, list(lp.text.encode()))
        assert [(t.token, t.logprob) for t in got.top_logprobs] == [(t.text, t.logprob) for t in lp.top]
        assert got.top_logprobs[0].token == got.token  # greedy: the most likely
    stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                               logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


async def test_completions_logprobs_in_the_legacy_form(oai: openai.AsyncOpenAI, queue: Client) -> None:
    whole = await oai.completions.create(model="tiny", prompt="Hello there", max_tokens=10, logprobs=2)
    want = await queue.generate(model="tiny", prompt="Hello there", max_tokens=10, logprobs=2, timeout=60)
    lps = whole.choices[0].logprobs
    assert lps is not None and want.logprobs is not None
    assert lps.tokens == [lp.text for lp in want.logprobs] and "".join(lps.tokens) == whole.choices[0].text
    assert lps.token_logprobs == [lp.logprob for lp in want.logprobs]
    assert lps.top_logprobs == [{t.text: t.logprob for t in lp.top} for lp in want.logprobs]
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(len(lps.tokens))]
    stream = await oai.completions.create(model="tiny", prompt="Hello there", max_tokens=10, logprobs=2, stream=True)
    chunks = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens or []] == lps.tokens
    assert [o for c in chunks for o in c.text_offset or []] == lps.text_offset


async def test_n_choices_are_n_jobs_of_one_prompt(oai: openai.AsyncOpenAI, queue: Client) -> None:
    greedy = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3)  # type: ignore[arg-type]
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: each choice the same text
    assert greedy.usage is not None and greedy.usage.completion_tokens == 3 * 8
    one = await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)  # type: ignore[arg-type]
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens if one.usage else False
    # Sampled with a seed: choice i is the job seeded seed + i, so the choices differ and repeat.
    ask: Any = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.5, "seed": 7, "n": 4}
    sampled = await oai.chat.completions.create(**ask)
    texts = [c.message.content for c in sampled.choices]
    again = await oai.chat.completions.create(**ask)
    assert len(set(texts)) > 1 and texts == [c.message.content for c in again.choices]
    for i in (0, 3):
        alone = await queue.generate(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.5, seed=7 + i,
                                     timeout=60)
        assert alone.text == texts[i]
    # Streamed: each chunk names its choice; the choices' texts are the whole response's.
    stream = await oai.chat.completions.create(**ask, stream=True)
    parts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    async for chunk in stream:
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [parts[i] for i in range(4)] == texts and finished == dict.fromkeys(range(4), "length")
    completions = await oai.completions.create(model="tiny", prompt="Hello", max_tokens=5, n=2)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text
