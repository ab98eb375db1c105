"""``api.gateway.job.JobStream``: what an HTTP client receives across resets, driven event by event.

Redis is fakeredis; a fake worker writes a job's events the way ``worker/jobs/table.py`` does (pub/sub and the
replay log) when it is submitted, and a health record says it serves the model. The real-worker version is
test_api_gateway_reset.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.errors import JobFailed
from mlxq.api.gateway.errors import GatewayError
from mlxq.api.gateway.job import JobStream
from mlxq.api.protocol.keys import log_entry_id
from mlxq.api.schema import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    GenerateRequest,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    Usage,
)
from tests.api.fake_queue import served_client

pytestmark = pytest.mark.unit

RID = "job-1"


def start(seq: int) -> StartEvent:
    return StartEvent(id=RID, seq=seq, model="m", worker="w", prompt_tokens=3)


def tokens(first_seq: int, *texts: str) -> list[Event]:
    return [TokenEvent(id=RID, seq=first_seq + i, text=t, token_ids=[i], index=i) for i, t in enumerate(texts)]


def reset(seq: int) -> ResetEvent:
    return ResetEvent(id=RID, seq=seq, reason="worker shut down", attempt=2)


def done(seq: int, reason: FinishReason = FinishReason.LENGTH) -> DoneEvent:
    return DoneEvent(id=RID, seq=seq, finish_reason=reason, usage=Usage(prompt_tokens=3, completion_tokens=9),
                     timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3, tokens_per_s=None))


def renumber(events: list[Event]) -> list[Event]:
    return [ev.model_copy(update={"seq": i}) for i, ev in enumerate(events)]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    async with served_client(capacity=1) as c:
        yield c


async def run(client: Client, events: list[Event]) -> JobStream:
    """Open a job whose (fake) worker writes ``events`` as it is submitted."""
    async def submit(request: GenerateRequest, **_: Any) -> str:
        redis = client._redis
        await redis.set(client.keys.job(request.id), request.model_dump_json())  # queued or running: cancellable
        for ev in renumber(events):
            data = ev.model_dump_json()
            await redis.publish(client.keys.events(RID), data)
            await redis.xadd(client.keys.log(RID), {"e": data}, id=log_entry_id(ev.seq))
        return request.id

    client.submit = submit  # type: ignore[method-assign]
    job = JobStream(client, GenerateRequest(id=RID, model="m", prompt="hi"))
    await job.open()
    return job


async def streamed(job: JobStream, out: list[str] | None = None) -> list[str]:
    """The deltas a client receives (into ``out`` as they come); the job closed after."""
    out = [] if out is None else out
    try:
        async for delta in job.deltas():
            out.append(delta.text)
    finally:
        await job.close()
    return out


async def test_a_greedy_rerun_repeating_the_text_in_other_pieces_continues_seamlessly(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "Hel", "lo w"), reset(0), start(0),
                             *tokens(0, "He", "llo", " wo", "rld"), done(0)])
    assert job.prompt_tokens == 3
    assert "".join(await streamed(job)) == "Hello world"
    assert job.done is not None and job.done.finish_reason is FinishReason.LENGTH


async def test_each_piece_of_text_is_sent_once_however_often_the_job_restarts(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "ab"), reset(0), *tokens(0, "a"), reset(0), start(0),
                             *tokens(0, "abc", "d"), done(0)])
    assert await streamed(job) == ["ab", "c", "d"]


async def test_a_rerun_that_diverges_fails_after_the_text_that_held(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "Hello", " world"), reset(0), start(0),
                             *tokens(0, "Help", " me"), done(0)])
    out: list[str] = []
    with pytest.raises(JobFailed) as failed:
        await streamed(job, out)
    assert out == ["Hello", " world"]  # nothing of the new run: "Help" already differs from "Hello"
    assert failed.value.code is ErrorCode.INTERNAL and "differs" in str(failed.value)
    assert await client._redis.exists(client.keys.cancel(RID))  # the job it no longer streams is cancelled


async def test_a_rerun_that_ends_short_of_the_text_sent_fails(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "Hello world"), reset(0), start(0), *tokens(0, "Hello"),
                             done(0, FinishReason.STOP)])
    with pytest.raises(JobFailed, match="differs"):
        await streamed(job)


async def test_a_whole_response_keeps_the_last_runs_text_even_when_it_differs(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "Hello"), reset(0), start(0), *tokens(0, "Goodbye"), done(0)])
    try:
        assert await job.whole() == "Goodbye"
    finally:
        await job.close()


async def test_a_job_that_fails_before_it_starts_raises_at_open(client: Client) -> None:
    error = ErrorEvent(id=RID, seq=0, code=ErrorCode.BAD_REQUEST, message="prompt too long")
    with pytest.raises(JobFailed, match="prompt too long"):
        await run(client, [error])


async def test_a_job_cancelled_by_someone_else_is_an_error_not_a_short_answer(client: Client) -> None:
    with pytest.raises(GatewayError) as caught:
        await run(client, [done(0, FinishReason.CANCELLED)])
    assert caught.value.problem.code == "cancelled" and caught.value.problem.status == 503


async def test_closing_a_job_still_running_cancels_it(client: Client) -> None:
    job = await run(client, [start(0), *tokens(0, "Hel")])
    deltas = job.deltas()
    assert (await anext(deltas)).text == "Hel"
    await deltas.aclose()
    await job.close()
    assert await client._redis.exists(client.keys.cancel(RID))
    assert job.ended


async def test_a_rerun_repeating_reasoning_and_text_in_other_pieces_continues_seamlessly(client: Client) -> None:
    def thought(seq: int, reasoning: str, text: str = "") -> TokenEvent:
        return TokenEvent(id=RID, seq=seq, text=text, token_ids=[seq], index=seq, reasoning=reasoning)

    job = await run(client, [start(0), thought(1, "let "), thought(2, "me", "A"), reset(3), start(4),
                             thought(5, "le"), thought(6, "t me see", "An"), thought(7, "", "swer"), done(8)])
    out: list[tuple[str, str]] = []
    try:
        async for delta in job.deltas():
            out.append((delta.reasoning, delta.text))
    finally:
        await job.close()
    assert "".join(r for r, _ in out) == "let me see" and "".join(t for _, t in out) == "Answer"


async def test_a_rerun_repeating_tokens_sends_their_logprobs_once(client: Client) -> None:
    from mlxq.api.schema import TokenLogprob

    def tok(seq: int, text: str, *ids: int) -> TokenEvent:
        return TokenEvent(id=RID, seq=seq, text=text, token_ids=list(ids), index=ids[0],
                          logprobs=[TokenLogprob(token=i, logprob=-float(i)) for i in ids])

    job = await run(client, [start(0), tok(1, "ab", 0, 1), reset(2), start(3), tok(4, "a", 0), tok(5, "bc", 1, 2),
                             done(6)])
    sent: list[int] = []
    try:
        async for delta in job.deltas():
            sent.extend(lp.token for lp in delta.logprobs)
    finally:
        await job.close()
    assert sent == [0, 1, 2]
