"""The whole path against real parts: a real Redis server, a real arq Worker, a real tiny MLX model."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest, JobFailed
from mlxq.api.history import RECENT_KEPT
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import DoneEvent, ErrorCode, ErrorEvent, Event, FinishReason, GenerateRequest, decode_event
from mlxq.engine.core.prompt import encode_prompt
from tests.support import (
    RunningWorker,
    collect,
    config_with,
    enqueue_raw,
    reference,
    reference_text,
    slow_steps,
    start_worker,
    terminal,
    text_of,
    wait_for,
)

pytestmark = pytest.mark.e2e

PROMPTS = [
    "a",
    "Hello world",
    "the quick brown fox jumps over the lazy dog " * 6,
    "Once upon a time",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Zebra",
    "In the beginning the queue was empty, and then jobs arrived one by one " * 3,
    "x y",
    "What is the capital of France?",
    "mlxq",
]
MAX_TOKENS = [24, 8, 40, 16, 32, 12, 20, 48, 5, 30]


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


def ids_of(events: list[Event]) -> list[int]:
    return [i for e in events if e.type == "token" for i in e.token_ids]


async def test_concurrent_greedy_jobs_match_mlx_lm_alone(worker: RunningWorker, client: Client,
                                                         reference_model: Any) -> None:
    tokenizer = reference_model[1]
    rids = await asyncio.gather(*(
        client.submit(model="tiny", prompt=p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)
    ))
    results = await asyncio.gather(*(collect(client, rid) for rid in rids))
    for prompt, max_tokens, events in zip(PROMPTS, MAX_TOKENS, results):
        expected = reference(reference_model, encode_prompt(tokenizer, prompt, None), max_tokens)
        end = terminal(events)
        assert isinstance(end, DoneEvent)
        assert ids_of(events) == expected, prompt
        assert text_of(events) == reference_text(reference_model, expected)
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[0].type == "start"
        assert end.usage.completion_tokens == len(expected)
        assert end.finish_reason is (FinishReason.LENGTH if len(expected) == max_tokens else FinishReason.STOP)


async def test_chat_messages_use_the_chat_template(worker: RunningWorker, client: Client,
                                                   reference_model: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    result = await client.generate(model="tiny", messages=messages, max_tokens=12, timeout=60)
    tokens = reference_model[1].apply_chat_template(messages, add_generation_prompt=True)
    assert result.token_ids == reference(reference_model, list(tokens), 12)
    assert result.usage.prompt_tokens == len(tokens)


async def test_stop_string_cuts_text_before_it(worker: RunningWorker, client: Client) -> None:
    full = await client.generate(model="tiny", prompt="Hello world", max_tokens=40, timeout=60)
    assert len(full.text) > 10
    stop = full.text[6:9]
    cut = full.text.index(stop)
    result = await client.generate(model="tiny", prompt="Hello world", max_tokens=40, stop=[stop], timeout=60)
    assert result.finish_reason is FinishReason.STOP
    assert result.text == full.text[:cut]


async def test_seeded_sampling_is_reproducible_within_a_batch(worker: RunningWorker, client: Client) -> None:
    params = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    a, b, c = await asyncio.gather(
        client.generate(seed=7, **params, timeout=60),
        client.generate(seed=7, **params, timeout=60),
        client.generate(seed=8, **params, timeout=60),
    )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_late_subscriber_gets_full_replay_once(worker: RunningWorker, client: Client) -> None:
    rid = await client.submit(model="tiny", prompt="Hello world", max_tokens=20)
    live = await collect(client, rid)
    late = await collect(client, rid)
    assert late == live
    assert [e.seq for e in late] == list(range(len(late)))
    terminal(late)


async def test_user_subscriber_sees_events_on_the_documented_channel(worker: RunningWorker, client: Client,
                                                                      redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    req = GenerateRequest(model="tiny", prompt="Hello", max_tokens=6)
    await pubsub.subscribe(f"mlxq:{{{req.id}}}:events")
    await client.submit(req)
    seen: list[Event] = []
    deadline = time.monotonic() + 30
    while (not seen or seen[-1].type not in ("done", "error")) and time.monotonic() < deadline:
        msg = await pubsub.get_message(timeout=1)  # None also for the (ignored) subscribe confirmation
        if msg is not None:
            seen.append(decode_event(msg["data"]))
    assert seen == await collect(client, req.id)
    await pubsub.aclose()
    await r.aclose()


# --- cancel ---------------------------------------------------------------------------------------
async def test_cancel_while_queued_never_enters_the_engine(worker_config: Any, client: Client) -> None:
    rid = await client.submit(model="tiny", prompt="Hello world", max_tokens=20)
    await client.cancel(rid)
    running = await start_worker(worker_config)
    try:
        events = await collect(client, rid)
        assert [e.type for e in events] == ["done"]
        assert isinstance(events[0], DoneEvent) and events[0].finish_reason is FinishReason.CANCELLED
        assert running.service.engine.stats.steps == 0
    finally:
        await running.close()


async def test_cancel_mid_prefill(worker_config: Any, client: Client) -> None:
    running = await start_worker(config_with(worker_config, prefill_step_size=8))
    slow_steps(running, 0.02)
    try:
        rid = await client.submit(model="tiny", prompt="the quick brown fox " * 25, max_tokens=8)
        events: list[Event] = []
        async for ev in client.events(rid, timeout=60):
            events.append(ev)
            if ev.type == "start":
                assert ev.prompt_tokens > 100  # ≥ 12 prefill chunks of 8 tokens at ≥ 20 ms each
                await client.cancel(rid)
        end = terminal(events)
        assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
        assert ids_of(events) == []  # ended before its first token: inside prefill
    finally:
        await running.close()


async def test_cancel_mid_decode_leaves_the_batch_intact(worker: RunningWorker, client: Client,
                                                         reference_model: Any) -> None:
    slow_steps(worker, 0.005)
    tokenizer = reference_model[1]
    others = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=30) for p in PROMPTS[:4]))
    victim = await client.submit(model="tiny", prompt="Hello world", max_tokens=200)
    events: list[Event] = []
    async for ev in client.events(victim, timeout=60):
        events.append(ev)
        if ev.type == "token" and ev.index >= 5 and len([e for e in events if e.type == "token"]) == 6:
            await client.cancel(victim)
    end = terminal(events)
    assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED
    assert 6 <= end.usage.completion_tokens < 200
    for prompt, rid in zip(PROMPTS[:4], others):
        evs = await collect(client, rid)
        assert ids_of(evs) == reference(reference_model, encode_prompt(tokenizer, prompt, None), 30)


async def test_cancel_after_the_end_changes_nothing(worker: RunningWorker, client: Client) -> None:
    rid = await client.submit(model="tiny", prompt="Hello", max_tokens=5)
    before = await collect(client, rid)
    await client.cancel(rid)
    await asyncio.sleep(0.3)
    assert await collect(client, rid) == before


# --- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ("not a dict", "invalid request"),
        ({"model": "tiny"}, "exactly one of 'prompt', 'messages' or 'input'"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "bogus": 1}, "bogus"),
        ({"model": "other", "prompt": "hi"}, "unknown model 'other'"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 100000}, "exceeds this worker's limit"),
        ({"model": "tiny", "prompt": "word " * 600}, "the limit is 512 (by "),
        ({"model": "tiny", "prompt": "word " * 400, "max_tokens": 200}, "exceeds the context (512) by "),
        ({"model": "tiny", "messages": []}, "messages"),
    ],
)
async def test_bad_payload_ends_with_bad_request_and_worker_keeps_serving(
    worker: RunningWorker, client: Client, redis_url: str, payload: Any, needle: str
) -> None:
    rid = GenerateRequest(model="tiny", prompt="x").id
    if isinstance(payload, dict):
        payload = {"id": rid, **payload}
    await enqueue_raw(redis_url, payload, rid)
    events = await collect(client, rid)
    end = terminal(events)
    assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST
    assert needle in end.message
    assert not end.retryable
    ok = await client.generate(model="tiny", prompt="still alive", max_tokens=4, timeout=60)
    assert ok.usage.completion_tokens == 4


async def test_client_refuses_invalid_requests_before_enqueueing(client: Client, redis_url: str) -> None:
    for fields in ({"model": "tiny", "prompt": ""}, {"model": "tiny", "prompt": "x", "max_tokens": 0},
                   {"model": "tiny"}, {"model": "tiny", "prompt": "x", "temperature": -1}):
        with pytest.raises(BadRequest):
            await client.submit(**fields)
    r = aredis.Redis.from_url(redis_url)
    assert await r.dbsize() == 0
    await r.aclose()


async def test_mlxq_submit_without_max_tokens_fits_the_context_as_the_gateway_does(
        worker: RunningWorker, reference_model: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from mlxq.api.cli import main

    prompt = "the sea and the ship " * 50
    tokens = len(encode_prompt(reference_model[1], prompt, None))
    assert tokens < 512 < tokens + 256  # the tiny model's context: 256, its old default, would not fit
    monkeypatch.setenv("MLXQ_REDIS_URL", redis_url)
    assert await asyncio.to_thread(main, ["submit", "--model", "tiny", "--seed", "1", prompt]) == 0
    generated = int(re.search(r"\[\w+: (\d+) tokens", capsys.readouterr().err).group(1))  # type: ignore[union-attr]
    assert 0 < generated <= 512 - tokens


async def test_job_past_its_deadline_ends_with_timeout(worker_config: Any, client: Client) -> None:
    running = await start_worker(config_with(worker_config, job_timeout_s=0.3))
    slow_steps(running, 0.02)
    try:
        rid = await client.submit(model="tiny", prompt="Hello", max_tokens=400)
        with pytest.raises(JobFailed) as info:
            await client.result(rid, timeout=60)
        assert info.value.code is ErrorCode.TIMEOUT
    finally:
        await running.close()


async def test_engine_step_failure_fails_in_flight_jobs_and_keeps_serving(worker: RunningWorker,
                                                                          client: Client) -> None:
    scheduler = worker.service.engine.scheduler
    backend = scheduler.backend
    real_step = backend.step
    armed = {"fail": False}

    def failing_step() -> Any:
        if armed["fail"]:
            armed["fail"] = False
            raise RuntimeError("[metal::malloc] simulated out of memory")
        return real_step()

    backend.step = failing_step
    slow_steps(worker, 0.01)
    rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=400) for p in ("a", "b c", "d")))
    await wait_for(lambda: scheduler.num_running == 3)
    armed["fail"] = True
    for rid in rids:
        end = terminal(await collect(client, rid))
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.ENGINE_ERROR
        assert "simulated out of memory" in end.message and end.retryable
    ok = await client.generate(model="tiny", prompt="after the failure", max_tokens=6, timeout=60)
    assert ok.usage.completion_tokens == 6


# --- the arq job around each run (worker/jobs/, worker/arqseam.py) ---------------------------------------
QUEUE = "mlxq:queue:tiny"


async def arq_keys_left(r: aredis.Redis, rid: str) -> list[str]:
    keys = [f"mlxq:{{{rid}}}:{name}" for name in ("job", "tries", "lease")]
    left = [k for k in keys if await r.exists(k)]
    return left + ([QUEUE] if await r.zscore(QUEUE, rid) is not None else [])


async def test_arq_sees_a_finished_job_as_complete_with_its_terminal_event(worker: RunningWorker, client: Client,
                                                                           redis_url: str) -> None:
    from arq.jobs import Job as ArqJob
    from arq.jobs import JobStatus

    from mlxq.api.protocol.jobrecord import JOB_FUNCTION
    from mlxq.api.protocol.keys import Keys
    from mlxq.worker.arqseam import arq_job

    result = await client.generate(model="tiny", prompt="Hello world", max_tokens=6, timeout=60)
    pool = aredis.Redis.from_url(redis_url)
    try:
        job = arq_job(pool, Keys("mlxq"), "tiny", result.id)
        assert isinstance(job, ArqJob)
        assert await job.status() is JobStatus.complete
        assert (await job.result(timeout=5))["finish_reason"] == "length"
        info = await job.result_info()
        assert info is not None and info.success and info.function == JOB_FUNCTION and info.job_try == 1
        assert list(info.args) == []  # the prompt is not kept a second time
        assert decode_event(json.dumps(info.result)) == DoneEvent.model_validate(info.result)
        assert info.result["usage"]["completion_tokens"] == 6
        assert await arq_keys_left(pool, result.id) == []
    finally:
        await pool.aclose()


async def test_a_queued_job_whose_record_vanished_is_moved_aside(worker: RunningWorker, client: Client,
                                                                   redis_url: str) -> None:
    from mlxq.api.errors import JobNotFound

    rid = GenerateRequest(model="tiny", prompt="x").id
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {rid: int(time.time() * 1000)})  # queued, but its job record is gone (expired)
        await wait_for(lambda: worker.host.dead_lettered == 1)
        (letter,) = [json.loads(x) for x in await r.lrange("mlxq:dead", 0, -1)]
        assert letter["entry"] == rid and letter["queue"] == QUEUE and "no job record" in letter["reason"]
        assert await r.zscore(QUEUE, rid) is None and await arq_keys_left(r, rid) == []
        with pytest.raises(JobNotFound):  # nothing was published for it: there is nothing to follow
            await collect(client, rid, timeout=30)
    finally:
        await r.aclose()


async def test_a_job_out_of_tries_ends_with_worker_lost(worker_config: Any, client: Client, redis_url: str) -> None:
    running = await start_worker(config_with(worker_config, max_tries=2))
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = GenerateRequest(model="tiny", prompt="x").id
        await r.set(f"mlxq:{{{rid}}}:tries", 2)  # two runs already started and were lost
        await enqueue_raw(redis_url, {"id": rid, "model": "tiny", "prompt": "Hello", "max_tokens": 4}, rid)
        end = terminal(await collect(client, rid))
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.WORKER_LOST and end.retryable
        assert "tried 2 times" in end.message
        assert running.service.engine.stats.steps == 0
        assert await arq_keys_left(r, rid) == []
    finally:
        await r.aclose()
        await running.close()


async def test_a_run_that_loses_its_lease_stops_and_a_later_run_finishes_the_job(
    worker_config: Any, client: Client, redis_url: str
) -> None:
    running = await start_worker(config_with(worker_config, lease_ttl_s=1.0, reap_interval_s=0.2))
    slow_steps(running, 0.01)
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = await client.submit(model="tiny", prompt="Hello world", max_tokens=60)
        events: list[Event] = []
        async for ev in client.events(rid, timeout=60):
            events.append(ev)
            if ev.type == "token" and not any(e.type == "reset" for e in events):
                await r.set(f"mlxq:{{{rid}}}:lease", "another-worker:9", px=1500)  # taken over
        resets = [i for i, e in enumerate(events) if e.type == "reset"]
        assert len(resets) == 1, [e.type for e in events]  # the later run announced itself once
        assert [e.seq for e in events] == list(range(len(events)))
        end = terminal(events)
        assert isinstance(end, DoneEvent) and end.usage.completion_tokens == 60
        # Its next write refused (fenced) or the lease keeper's refresh (every ttl/3) finding the lease taken,
        # whichever comes first: either stops the run, and both count as a lease loss.
        assert running.host.runs.stats.lease_losses >= 1
        assert running.worker.jobs_retried >= 1
        assert await arq_keys_left(r, rid) == []
    finally:
        await r.aclose()
        await running.close()


async def test_a_run_whose_data_redis_lost_ends_once_with_data_lost(worker_config: Any, redis_url: str) -> None:
    # FLUSHALL as a restart without persistence does; the lease keeper and the run table both find the run
    # lost, and a third caller too: the job still gets exactly one terminal event.
    running = await start_worker(config_with(worker_config, lease_ttl_s=1.0, reap_interval_s=0.2))
    slow_steps(running, 0.01)
    host = running.host
    r = aredis.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    try:
        async with Client(redis_url) as client:
            rid = await client.submit(model="tiny", prompt="Hello world", max_tokens=400)
            await wait_for(lambda: rid in host.runs and host.runs[rid].completion_tokens > 2)
        run = host.runs[rid]
        await pubsub.subscribe(f"mlxq:{{{rid}}}:events")
        assert (await pubsub.get_message(timeout=5.0) or {}).get("type") == "subscribe"
        await r.flushall()
        await asyncio.gather(host.runs.lose([run]), host.runs.lose([run]))
        await wait_for(lambda: host.runs.stats.data_lost == 1)
        await asyncio.sleep(1.0)  # the lease keeper and the run table have found it lost too
        published = []
        while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
            published.append(decode_event(msg["data"]))
        assert [e.type for e in published if e.type in ("done", "error")] == ["error"], published
        end = published[-1]
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.DATA_LOST and end.retryable
        assert [decode_event(f[b"e"]) for _, f in await r.xrange(f"mlxq:{{{rid}}}:log")] == [end]
        assert host.runs.stats.data_lost == 1 and rid not in host.runs
        result = await client_after(redis_url).generate(model="tiny", prompt="served on", max_tokens=3, timeout=60)
        assert result.usage.completion_tokens == 3
    finally:
        await pubsub.aclose()
        await r.aclose()
        await running.close()


def client_after(redis_url: str) -> Client:
    return Client(redis_url)


async def test_a_bug_in_a_job_run_neither_stops_the_worker_nor_loses_the_job(worker_config: Any,
                                                                             client: Client) -> None:
    running = await start_worker(config_with(worker_config, lease_ttl_s=1.0, reap_interval_s=0.2))
    host = running.host
    serve = host._serve
    calls: list[str] = []

    async def broken_once(service: Any, start: Any) -> Any:
        if not calls:
            calls.append(start.rid)
            raise RuntimeError("a bug")
        return await serve(service, start)

    host._serve = broken_once
    try:
        rid = await client.submit(model="tiny", prompt="Hello world", max_tokens=8)
        events = await collect(client, rid)  # the lease lapses, the reaper re-queues it, the next run ends it
        assert calls == [rid]
        assert [e.type for e in events if e.type in ("reset", "done")] == ["reset", "done"]
        assert running.worker.jobs_failed == 1 and not running.task.done()
    finally:
        await running.close()


async def test_a_job_an_earlier_run_ended_is_not_run_again(worker_config: Any, client: Client, redis_url: str) -> None:
    running = await start_worker(worker_config)
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = GenerateRequest(model="tiny", prompt="x").id
        ended = DoneEvent(id=rid, seq=0, finish_reason=FinishReason.CANCELLED,
                          usage={"prompt_tokens": 0, "completion_tokens": 0},
                          timings={"queue_ms": 1, "ttft_ms": None, "total_ms": 1, "tokens_per_s": None})
        await r.xadd(f"mlxq:{{{rid}}}:log", {"e": ended.model_dump_json()}, id="0-1")  # e.g. a reaper's end
        await enqueue_raw(redis_url, {"id": rid, "model": "tiny", "prompt": "Hello", "max_tokens": 4}, rid)
        for _ in range(500):
            if not await arq_keys_left(r, rid):
                break
            await asyncio.sleep(0.01)
        assert await arq_keys_left(r, rid) == []
        assert [e.seq for e in await collect(client, rid)] == [0]  # nothing more was published
        assert running.service.engine.stats.steps == 0
        assert not await r.hexists("mlxq:running", rid)
    finally:
        await r.aclose()
        await running.close()


# --- Redis hygiene and cost ------------------------------------------------------------------------
async def test_every_key_has_a_ttl_after_jobs_end(worker: RunningWorker, client: Client, redis_url: str) -> None:
    rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=8) for p in PROMPTS[:5]))
    await client.cancel(rids[0])
    for rid in rids:
        await collect(client, rid)
    r = aredis.Redis.from_url(redis_url)  # the terminal event's own call finished the arq job
    persistent = [k async for k in r.scan_iter() if await r.ttl(k) == -1]
    await r.aclose()
    assert persistent == []


async def test_one_redis_round_trip_per_engine_step_at_most(worker: RunningWorker, client: Client) -> None:
    service, host = worker.service, worker.host
    writes0, steps0 = host.runs.stats.writes, service.engine.stats.steps
    rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=32) for p in PROMPTS[:8]))
    for rid in rids:
        await collect(client, rid)
    writes = host.runs.stats.writes - writes0
    steps = service.engine.stats.steps - steps0
    assert steps >= 32
    assert writes <= steps


async def test_a_freed_slot_takes_a_queued_job_without_waiting_for_the_poll(worker_config: Any, client: Client
                                                                           ) -> None:
    # Two slots, five jobs, and an hour between polls: only job ends can start the three left queued.
    running = await start_worker(config_with(worker_config, capacity=2, max_jobs=2, poll_delay_s=3600.0))
    polls = count_polls(running)
    try:
        rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=4) for p in PROMPTS[:5]))
        for rid in rids:
            assert (await collect(client, rid, timeout=60))[-1].type == "done"
        assert polls[0] >= 3  # the queued jobs were taken by polls that job ends woke
        # Jobs enqueued while every slot is busy (arq skips the poll of a full worker) start as slots free.
        busy = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=300) for p in PROMPTS[:2]))
        while not all(rid in running.host.runs for rid in busy):
            await asyncio.sleep(0.005)
        later = [await client.submit(model="tiny", prompt=p, max_tokens=4) for p in PROMPTS[2:4]]
        for rid in [*busy, *later]:
            assert (await collect(client, rid, timeout=60))[-1].type == "done"
        # With nothing queued and a slot to spare, a job's end does not poll: its enqueue's wake-up polled once.
        await asyncio.sleep(0.1)
        before = polls[0]
        await collect(client, await client.submit(model="tiny", prompt="alone", max_tokens=4), timeout=60)
        await asyncio.sleep(0.1)
        assert polls[0] - before == 1, "a job's end polled the queue with nothing queued"
    finally:
        await running.close()


def count_polls(running: RunningWorker) -> list[int]:
    """Counts this worker's queue reads (arq's poll: a claim) in the returned one-item list."""
    count = [0]
    claim = running.host.claim

    async def counting(free: int) -> Any:
        count[0] += 1
        return await claim(free)

    running.host.claim = counting
    return count


async def test_payload_on_the_wire_is_json(worker: RunningWorker, client: Client, redis_url: str) -> None:
    req = GenerateRequest(model="tiny", prompt="no pickle", max_tokens=2)
    await client.submit(req)
    r = aredis.Redis.from_url(redis_url)
    raw = await r.get(f"mlxq:{{{req.id}}}:job")
    await r.aclose()
    assert raw is not None
    assert json.loads(raw)["a"][0]["prompt"] == "no pickle"
    await client.result(req.id, timeout=60)


async def test_following_an_unknown_job_raises_job_not_found(client: Client) -> None:
    from mlxq.api.errors import JobNotFound

    with pytest.raises(JobNotFound):
        await collect(client, "no-such-job", timeout=30)


async def test_one_client_follows_many_jobs_over_one_pubsub_connection(worker: RunningWorker, client: Client,
                                                                       redis_url: str) -> None:
    # Slow enough that no job ends before its follower is in (40 steps of 50 ms), on a loaded host too.
    slow_steps(worker, 0.05)
    rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=40) for p in PROMPTS))
    streams = [asyncio.ensure_future(collect(client, rid)) for rid in rids]
    r = aredis.Redis.from_url(redis_url)
    # The worker claims what its batch can start (8); the other jobs wait in Redis, followed all the same.
    await wait_for(lambda: len(worker.host.runs) == min(len(rids), worker.host.config.capacity))
    # The followers subscribe as their tasks get to run: poll until every channel has its one follower.
    channels = [f"mlxq:{{{rid}}}:events" for rid in rids]
    end = asyncio.get_running_loop().time() + 60
    while not all(n == 1 for _, n in await r.pubsub_numsub(*channels)):
        assert asyncio.get_running_loop().time() < end, await r.pubsub_numsub(*channels)
        await asyncio.sleep(0.01)
    subscribers = [c for c in await r.client_list() if int(c["sub"]) > 0]
    results = await asyncio.gather(*streams)
    await r.aclose()
    # Every job's channel is followed over one shared connection, holding them all. The test server's other
    # subscribers (the worker's cancel and queue wake-ups, a connection of an earlier test not yet closed) hold a
    # channel or two.
    followers = [c for c in subscribers if int(c["sub"]) >= len(rids)]
    assert len(followers) == 1 and int(followers[0]["sub"]) == len(rids), subscribers
    assert all(isinstance(terminal(evs), DoneEvent) for evs in results)


async def test_two_deployments_share_one_redis_without_sharing_ids_or_keys(worker_config: Any, redis_url: str
                                                                          ) -> None:
    # Issue 13, scenario 7: arq's job, result, retry and in-progress keys were global, so one deployment's
    # submit(id=X) raised DuplicateJob because the other had used X.
    from arq.jobs import JobStatus

    from mlxq.api.protocol.keys import Keys
    from mlxq.worker.arqseam import arq_job

    workers = [await start_worker(config_with(worker_config, prefix=p)) for p in ("alpha", "beta")]
    r = aredis.Redis.from_url(redis_url)
    try:
        async with Client(redis_url, prefix="alpha") as alpha, Client(redis_url, prefix="beta") as beta:
            results = await asyncio.gather(alpha.generate(model="tiny", prompt="one", max_tokens=3, id="same-id"),
                                           beta.generate(model="tiny", prompt="two", max_tokens=5, id="same-id"))
        assert [x.usage.completion_tokens for x in results] == [3, 5]
        for prefix in ("alpha", "beta"):
            assert await arq_job(r, Keys(prefix), "tiny", "same-id").status() is JobStatus.complete
        keys = sorted([k.decode() async for k in r.scan_iter()])
        assert keys and all(k.startswith(("alpha:", "beta:")) for k in keys), keys
        ttls = {k: await r.ttl(k) for k in keys}
        assert all(t > 0 for t in ttls.values()), ttls
    finally:
        await r.aclose()
        for w in workers:
            await w.close()


async def test_a_jobs_end_keeps_the_recent_list_bounded_and_its_history_expiring(worker: RunningWorker,
                                                                                 client: Client,
                                                                                 redis_url: str) -> None:
    # EMIT trims the recent list only once it is one over, and gives a history bucket its TTL when it is new
    r = aredis.Redis.from_url(redis_url)
    keys = Keys("mlxq")
    await r.lpush(keys.recent(), *[b"{}"] * RECENT_KEPT)
    rids: list[str] = []
    for _ in range(2):  # each end: one over the bound, trimmed back
        rids.append(await client.submit(model="tiny", prompt="Hello world", max_tokens=4))
        terminal(await collect(client, rids[-1]))
        assert await r.llen(keys.recent()) == RECENT_KEPT
    assert {json.loads(s)["id"] for s in await r.lrange(keys.recent(), 0, 1)} == set(rids)
    assert await r.ttl(keys.recent()) > 0
    buckets = [k async for k in r.scan_iter(match=keys.history("tiny", 0).rsplit(":", 1)[0] + ":*")]
    assert buckets and all([await r.ttl(k) > 0 for k in buckets])
    assert sum([int(await r.hget(k, "n") or 0) for k in buckets]) == 2
    await r.aclose()


async def test_the_benchs_queue_run_names_each_job_so_its_ttft_splits_at_the_worker(worker: RunningWorker,
                                                                                   client: Client) -> None:
    from mlxq.worker.tools.bench.paths import run_queue

    run = await run_queue(client, "tiny", PROMPTS[:4], 6)
    assert len(run.rids) == len(run.ttft_ms) == 4 and len(set(run.rids)) == 4
    results = await asyncio.gather(*(client.result(rid, timeout=10) for rid in run.rids))
    assert sum(r.usage.completion_tokens for r in results) == run.tokens
    assert all(r.timings.ttft_ms is not None for r in results)  # what tests.perf.burst splits the client's TTFT by
