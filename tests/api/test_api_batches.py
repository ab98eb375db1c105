"""The batch machinery without a model: file chunks, line validation, the batch records' scripts, and the feeder's
state machine, on fakeredis with a fake worker that ends each queued job as ``worker/jobs/table.py`` would (its
events in the replay log and on its channel). The real-worker version is test_api_gateway_batches."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from mlxq.api.batches import LEASE, BatchStatus, BatchStore
from mlxq.api.batchline import LineError, chunk_lines, parse_line
from mlxq.api.client import Client
from mlxq.api.drive import Drive
from mlxq.api.errors import BadRequest, NotFound
from mlxq.api.feeder import BatchFeeder, FeederSettings
from mlxq.api.files import FileLimits, FileStore, chunked
from mlxq.api.protocol.keys import log_entry_id
from mlxq.api.schema import (
    DoneEvent,
    Event,
    FinishReason,
    GenerateRequest,
    StartEvent,
    Timings,
    TokenEvent,
    Usage,
)
from tests.api.fake_queue import served_client

pytestmark = pytest.mark.unit

URL = "/v1/chat/completions"


# --- files and lines ----------------------------------------------------------------------------------------------
def test_chunks_end_at_line_ends_and_count_their_lines() -> None:
    data = b"".join(b"%d:" % i + b"x" * (i * 7 % 50) + b"\n" for i in range(300)) + b"last-without-newline"
    chunks, counts = chunked(data, size=256)
    assert b"".join(chunks) == data and len(chunks) > 5
    assert all(c.endswith(b"\n") for c in chunks[:-1])
    assert [len(chunk_lines(c)) for c in chunks] == counts and sum(counts) == 301


def test_a_line_longer_than_a_chunk_is_one_chunk() -> None:
    data = b"a\n" + b"y" * 1000 + b"\nb\n"
    chunks, counts = chunked(data, size=100)
    assert b"".join(chunks) == data and b"y" * 1000 + b"\n" in chunks and sum(counts) == 3


@pytest.mark.parametrize(("raw", "code"), [
    (b"{oops", "invalid_json_line"), (b"[1, 2]", "invalid_json_line"), (b"", "invalid_json_line"),
    (b'{"method": "POST", "url": "/v1/chat/completions", "body": {}}', "missing_custom_id"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}', "invalid_method"),
    (b'{"custom_id": "a", "url": "/v1/completions", "body": {}}', "invalid_url"),
    (b'{"custom_id": "a", "url": "/v1/chat/completions", "body": "x"}', "invalid_body"),
])
def test_a_malformed_line_is_that_lines_error(raw: bytes, code: str) -> None:
    with pytest.raises(LineError) as refused:
        parse_line(4, raw, URL)
    assert refused.value.code == code and "line 5" in refused.value.message


def test_a_good_line_parses() -> None:
    line = parse_line(0, b'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"a": 1}}',
                      URL)
    assert (line.custom_id, line.body) == ("c", {"a": 1})


# --- records --------------------------------------------------------------------------------------------------------
@pytest.fixture
async def client() -> AsyncIterator[Client]:
    async with served_client(capacity=4) as c:
        yield c


def store_of(client: Client, **limits: Any) -> BatchStore:
    return BatchStore(client.redis, client.keys, FileStore(client.redis, client.keys, FileLimits(**limits)))


def line(cid: str, prompt: str = "hi", model: str = "m") -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": URL,
                       "body": {"model": model, "prompt": prompt}}).encode()


def lines(n: int) -> bytes:
    """An input file of ``n`` good lines."""
    return b"\n".join(line(f"c{i}", f"p{i}") for i in range(n)) + b"\n"


async def batch_of(store: BatchStore, data: bytes) -> dict[str, Any]:
    """A batch (tenant t) of an input file holding ``data``."""
    fid = (await store.files.create(data, "f", "batch", "t"))["id"]
    return await store.create(fid, URL, "t")


async def test_files_are_their_tenants_and_kept_within_the_limits(client: Client) -> None:
    files = store_of(client, max_lines=3, max_bytes=1000).files
    made = await files.create(b"a\nb\n", "f.jsonl", "batch", "t1")
    assert (await files.get(made["id"], "t1"))["bytes"] == 4
    assert b"".join([c async for c in files.content(made["id"], "t1")]) == b"a\nb\n"
    with pytest.raises(NotFound):
        await files.get(made["id"], "t2")
    with pytest.raises(BadRequest, match="MLXQ_BATCH_MAX_LINES"):
        await files.create(b"1\n2\n3\n4\n", "f.jsonl", "batch", "t1")
    with pytest.raises(BadRequest, match="MLXQ_BATCH_MAX_FILE_BYTES"):
        await files.create(b"x" * 1001, "f.jsonl", "batch", "t1")
    assert [f["id"] for f in (await files.listing("t1"))["data"]] == [made["id"]]
    await files.delete(made["id"], "t1")
    assert (await files.listing("t1"))["data"] == []


async def test_a_status_moves_only_from_the_statuses_named(client: Client) -> None:
    store = store_of(client)
    b = await batch_of(store, line("a") + b"\n")
    assert not await store.move(b["id"], (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING)
    assert (await store.cancel(b["id"], "t"))["status"] == "cancelling"
    assert (await store.cancel(b["id"], "t"))["status"] == "cancelling"  # again: as it is
    assert await store.move(b["id"], (BatchStatus.CANCELLING,), BatchStatus.CANCELLED)
    assert not await client.redis.sismember(client.keys.batches_open(), b["id"])
    assert (await store.cancel(b["id"], "t"))["status"] == "cancelled"  # as it is
    assert await store.move(b["id"], (BatchStatus.CANCELLED,), BatchStatus.COMPLETED)  # (only to test the refusal)
    with pytest.raises(BadRequest, match="cannot be cancelled"):
        await store.cancel(b["id"], "t")


async def test_a_lease_is_one_feeders_at_a_time(client: Client) -> None:
    key = {"lease_key": client.keys.batch_lease("b")}
    assert await LEASE.run(client.redis, key, {"feeder": "one", "ttl_ms": 10_000})
    assert not await LEASE.run(client.redis, key, {"feeder": "two", "ttl_ms": 10_000})
    assert await LEASE.run(client.redis, key, {"feeder": "one", "ttl_ms": 10_000})  # renewed by its holder


# --- the feeder -------------------------------------------------------------------------------------------------
class _Job:
    def __init__(self, request: GenerateRequest) -> None:
        self.request = request

    def render(self, events: Sequence[Event]) -> dict[str, Any]:
        text = "".join(ev.text for ev in events if isinstance(ev, TokenEvent))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        return {"text": text, "usage": {"prompt_tokens": done.usage.prompt_tokens,
                                        "completion_tokens": done.usage.completion_tokens}}


class FakeCodec:
    def prepare(self, endpoint: str, body: Any) -> _Job:
        if not body.get("prompt"):
            raise LineError("invalid_request", "prompt is required")
        return _Job(GenerateRequest(model=body["model"], prompt=body["prompt"], max_tokens=4))


class FakeWorker:
    """Ends each queued job of model ``m`` (from its bulk band's queue, where batch lines run): its prompt
    upper-cased as its text. Notes how many lines were in flight at most, and how many times each job was
    claimed."""

    def __init__(self, client: Client, bid: str) -> None:
        self.client, self.bid = client, bid
        self.claims: dict[str, int] = {}
        self.most_inflight = 0
        self.paused = False
        self.budget: int | None = None  # jobs it ends normally before it only ends cancelled ones

    async def run(self) -> None:
        r, keys = self.client.redis, self.client.keys
        while True:
            self.most_inflight = max(self.most_inflight, await r.scard(keys.batch_inflight(self.bid)))
            popped = [] if self.paused else await r.zpopmin(keys.queue("m", "t", bulk=True), 2)
            for rid_raw, score in popped:
                rid = rid_raw.decode()
                if self.budget is not None and not await r.exists(keys.cancel(rid)):
                    if self.budget == 0:
                        await r.zadd(keys.queue("m", "t", bulk=True), {rid: score})  # left queued
                        continue
                    self.budget -= 1
                self.claims[rid] = self.claims.get(rid, 0) + 1
                job = json.loads(await r.get(keys.job(rid)))
                prompt = job["a"][0]["prompt"]
                await self.end(rid, str(prompt).upper())
            await asyncio.sleep(0.005)

    async def end(self, rid: str, text: str) -> None:
        r, keys = self.client.redis, self.client.keys
        reason = FinishReason.CANCELLED if await r.exists(keys.cancel(rid)) else FinishReason.STOP
        evs: list[Event] = [StartEvent(id=rid, seq=0, model="m", worker="w", prompt_tokens=2),
                            TokenEvent(id=rid, seq=1, text=text, token_ids=[1], index=0),
                            DoneEvent(id=rid, seq=2, finish_reason=reason,
                                      usage=Usage(prompt_tokens=2, completion_tokens=1),
                                      timings=Timings(queue_ms=1, ttft_ms=1, total_ms=1, tokens_per_s=None))]
        for ev in evs:
            await r.xadd(keys.log(rid), {"e": ev.model_dump_json()}, id=log_entry_id(ev.seq))
            await r.publish(keys.events(rid), ev.model_dump_json())
        await r.delete(keys.job(rid))


@contextlib.asynccontextmanager
async def running(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def settled(store: BatchStore, bid: str, tenant: str = "t") -> dict[str, Any]:
    async with asyncio.timeout(8):
        while (b := await store.get(bid, tenant))["status"] not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.01)
    return b


async def test_the_feeder_keeps_a_window_in_flight_and_records_each_line_once(client: Client) -> None:
    store = store_of(client)
    data = b"\n".join([line(f"c{i}", f"p{i}") for i in range(20)] + [b"{bad", line("c3"), line("c21", "")]) + b"\n"
    b = await batch_of(store, data)
    worker = FakeWorker(client, b["id"])
    feeder = BatchFeeder(client, store, FakeCodec(), FeederSettings(window=3, poll_s=0.01))
    async with running(worker.run()), running(feeder.run()):
        b = await settled(store, b["id"])
    assert b["status"] == "completed" and b["request_counts"] == {"total": 23, "completed": 20, "failed": 3}
    assert worker.most_inflight <= 3 and set(worker.claims.values()) == {1} and len(worker.claims) == 20
    out, err = await store.results(b["id"], "t")
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(20)]  # input order
    assert all(o["response"]["body"]["text"] == f"P{i}" for i, o in enumerate(out))
    assert sorted(e["error"]["code"] for e in err) == ["duplicate_custom_id", "invalid_json_line", "invalid_request"]
    assert b["usage"]["input_tokens"] == 40 and b["usage"]["output_tokens"] == 20
    assert not await client.redis.exists(client.keys.batch_results(b["id"]), client.keys.batch_inflight(b["id"]))
    note = await client.redis.xrange(client.keys.webhooks())
    assert [(f[b"type"], f[b"id"].decode()) for _, f in note] == [(b"batch.completed", b["id"])]


async def test_a_feeder_taking_over_follows_the_lines_in_flight_and_feeds_none_twice(client: Client) -> None:
    store = store_of(client)
    bid = (await batch_of(store, lines(12)))["id"]
    worker = FakeWorker(client, bid)
    worker.paused = True  # the first feeder's jobs stay queued
    first = BatchFeeder(client, store, FakeCodec(), FeederSettings(window=4, poll_s=0.01, lease_ms=300))
    async with running(worker.run()):
        first.start()
        async with asyncio.timeout(10):
            while await client.redis.zcard(client.keys.queue("m", "t", bulk=True)) < 4:
                await asyncio.sleep(0.01)
        first._task.cancel()  # type: ignore[union-attr]  # dies: its lease is left to lapse
        for task in list(first._driving.values()):
            task.cancel()
        await asyncio.sleep(0)
        await client.redis.set(client.keys.batch_lease(bid), first.id, px=300)  # as a dead feeder leaves it
        second = BatchFeeder(client, store, FakeCodec(), FeederSettings(window=4, poll_s=0.01))
        worker.paused = False
        async with running(second.run()):
            b = await settled(store, bid)
    assert b["status"] == "completed" and b["request_counts"]["completed"] == 12
    assert len(worker.claims) == 12 and set(worker.claims.values()) == {1}  # no line enqueued twice


async def test_a_file_that_is_no_jsonl_fails_its_batch(client: Client) -> None:
    store = store_of(client)
    bid = (await batch_of(store, b"not json\nnor this\n"))["id"]
    feeder = BatchFeeder(client, store, FakeCodec(), FeederSettings(poll_s=0.01))
    await Drive(feeder, bid).run()
    b = await store.get(bid, "t")
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "invalid_json_line"
    assert not await client.redis.sismember(client.keys.batches_open(), bid)


async def test_a_cancel_keeps_the_finished_lines_and_ends_the_rest_cancelled(client: Client) -> None:
    store = store_of(client)
    bid = (await batch_of(store, lines(12)))["id"]
    worker = FakeWorker(client, bid)
    worker.budget = 5  # then the rest stay queued until cancelled
    feeder = BatchFeeder(client, store, FakeCodec(), FeederSettings(window=4, poll_s=0.01))
    async with running(worker.run()), running(feeder.run()):
        async with asyncio.timeout(10):
            while (await store.get(bid, "t"))["request_counts"]["completed"] < 5:
                await asyncio.sleep(0.01)
        assert (await store.cancel(bid, "t"))["status"] == "cancelling"
        b = await settled(store, bid)
    assert b["status"] == "cancelled" and b["request_counts"] == {"total": 12, "completed": 5, "failed": 7}
    out, err = await store.results(bid, "t")
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"c{i}" for i in range(12))
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"} and len(out) == 5
    note = await client.redis.xrange(client.keys.webhooks())
    assert [f[b"type"] for _, f in note] == [b"batch.cancelled"]
