"""Tenants on a real Redis: their queues, the fair share CLAIM keeps by weight and work, and their caps
(max-running across workers and after a worker's death, max-queued, tokens per minute); then a real worker's
result naming its tenant."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api import tenants
from mlxq.api.cli import main
from mlxq.api.client import Client
from mlxq.api.errors import BadRequest, JobFailed, QueueFull
from mlxq.api.protocol.claim import BelowShare, EntryStatus, Outranking
from mlxq.api.protocol.emit import LogTTL, Write
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import ErrorCode, FinishReason
from mlxq.worker.jobs.run import Run
from mlxq.worker.jobs.transitions import Record, Transitions
from tests.support import RunningWorker, config_with, free_port, start_worker
from tests.worker.test_worker_metrics import scrape, value

pytestmark = pytest.mark.e2e

KEYS = Keys("mlxq")
MODEL = "m"


def worker(r: aredis.Redis, name: str = "w1", lease_s: float = 30.0) -> Transitions:
    return Transitions(r, KEYS, name, LogTTL(), lease_ttl_s=lease_s)


async def fill(client: Client, tenant: str, n: int, **fields: object) -> list[str]:
    return list(await asyncio.gather(*(client.submit(model=MODEL, prompt="x", tenant=tenant, **fields)
                                       for _ in range(n))))


async def claim(t: Transitions, n: int) -> list[Run]:
    due = await t.claim({KEYS.queue(MODEL): n}, n)
    return [t.run(e, MODEL, 0) for e in due.entries if e.status is EntryStatus.STARTED]


async def end(t: Transitions, run: Run, prompt: int, generated: int) -> None:
    events = [run.start(prompt, t.worker_id), run.done(FinishReason.LENGTH, generated=generated)]
    assert await t.write([Record(run, events, Write.END)]) == [True]


async def running_of(r: aredis.Redis, tenant: str) -> int:
    return int(await r.hget(KEYS.tenants_running(), tenant) or 0)  # type: ignore[misc]


# --- a job's tenant ------------------------------------------------------------------------------------
async def test_a_tenants_jobs_wait_on_its_own_queue_and_a_malformed_name_is_refused(client: Client,
                                                                                   r: aredis.Redis) -> None:
    await fill(client, "acme", 2)
    await fill(client, "default", 1)
    assert await r.zcard(KEYS.queue(MODEL, "acme")) == 2
    assert await r.zcard(KEYS.queue(MODEL)) == 1
    assert KEYS.queue_of(KEYS.queue("org/model:4bit", "acme")) == ("org/model:4bit", "acme")
    assert {m.decode() for m in await r.smembers(KEYS.backlog(MODEL))} == {"acme", "default"}  # type: ignore[misc]
    for bad in ("", "a" * 65, "no spaces", "a:b"):
        with pytest.raises(BadRequest, match="tenant"):
            await client.submit(model=MODEL, prompt="x", tenant=bad)
        with pytest.raises(BadRequest, match="tenant"):
            Client(tenant=bad)


async def test_the_clients_tenant_applies_unless_a_submit_names_its_own(redis_url: str, r: aredis.Redis) -> None:
    async with Client(redis_url, tenant="globex") as c:
        await c.submit(model=MODEL, prompt="x")
        await c.submit(model=MODEL, prompt="x", tenant="acme")
    assert await r.zcard(KEYS.queue(MODEL, "globex")) == 1
    assert await r.zcard(KEYS.queue(MODEL, "acme")) == 1


# --- the fair share ----------------------------------------------------------------------------------------
async def shares(client: Client, r: aredis.Redis, work: dict[str, tuple[int, int]], slots: int = 8,
                 ends: int = 240) -> Counter[str]:
    """Serve two backlogged tenants on one worker of ``slots``: end the oldest running job, claim the freed
    slot; the work (prompt + generated tokens) each tenant got over ``ends`` ends."""
    for tenant in work:
        await fill(client, tenant, ends + slots + 8)
    t = worker(r)
    running = await claim(t, slots)
    got: Counter[str] = Counter()
    for _ in range(ends):
        run = running.pop(0)
        prompt, generated = work[run.tenant]
        await end(t, run, prompt, generated)
        got[run.tenant] += prompt + generated
        running += await claim(t, slots - len(running))
    return got


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
async def test_backlogged_tenants_share_the_work_by_weight(client: Client, r: aredis.Redis,
                                                           weights: tuple[int, int]) -> None:
    await tenants.store(r, KEYS, "acme", weight=weights[0])
    await tenants.store(r, KEYS, "globex", weight=weights[1])
    got = await shares(client, r, {"acme": (20, 80), "globex": (20, 80)})
    want = weights[0] / sum(weights)
    assert abs(got["acme"] / sum(got.values()) - want) <= 0.1 * want


async def test_a_tenant_of_long_jobs_gets_its_share_of_work_not_of_jobs(client: Client, r: aredis.Redis) -> None:
    got = await shares(client, r, {"acme": (100, 300), "globex": (20, 80)})
    assert abs(got["acme"] / sum(got.values()) - 0.5) <= 0.05


async def test_priority_orders_a_tenants_own_jobs_only(client: Client, r: aredis.Redis) -> None:
    low = await fill(client, "acme", 3)
    high = await fill(client, "globex", 3, priority=10)
    urgent = await fill(client, "acme", 1, priority=10)
    started = [run.rid for run in await claim(worker(r), 4)]
    assert started[0] in high + urgent  # each tenant's first is its highest priority
    assert set(started) & set(high) and urgent[0] in started and len(set(started) & set(low)) == 1


async def test_a_full_engine_claims_only_a_tenant_below_its_share_there(client: Client, r: aredis.Redis) -> None:
    flood = await fill(client, "acme", 3)
    t = worker(r)
    queue = KEYS.queue(MODEL)
    # acme runs 2 there (spare load (2 - 1) / 1 = 1): acme's own load after one more would be 3, globex's 1
    due = await t.claim({queue: 1}, 1, below_share={queue: BelowShare(1.0, {"acme": 2})})
    assert due.entries == [] and due.left  # acme's jobs are no one's to take there; they stay queued
    probe = await fill(client, "globex", 2)
    due = await t.claim({queue: 1}, 1, below_share={queue: BelowShare(1.0, {"acme": 2})})
    (first,) = [e.rid for e in due.entries]
    assert first in probe and due.left
    # at equal loads (1 each: spare 0) nobody is below: nothing is taken
    due = await t.claim({queue: 1}, 1, below_share={queue: BelowShare(0.0, {"acme": 1, "globex": 1})})
    assert due.entries == [] and due.left
    # weight 3: globex's load after one more, (1 + 1) / 3, is within acme's spare 1
    await tenants.store(r, KEYS, "globex", weight=3)
    due = await t.claim({queue: 1}, 1, below_share={queue: BelowShare(1.0, {"acme": 2, "globex": 1})})
    assert [e.rid for e in due.entries] == [rid for rid in probe if rid != first]
    # with room (no below_share), the flood is claimed as before
    due = await t.claim({queue: 3}, 3)
    assert {e.rid for e in due.entries} == set(flood)


async def test_a_full_engine_takes_only_as_many_of_a_below_share_tenants_jobs_as_its_share_has_room_for(
        client: Client, r: aredis.Redis) -> None:
    # A full engine of priority-0 jobs may take as many outranking jobs as it runs (one each); a tenant below its
    # share took that many of its own too, out of the fair order, where one job brought it to its share.
    await tenants.store(r, KEYS, "acme", weight=3)
    probe = await fill(client, "globex", 5)
    await fill(client, "acme", 5)
    t, queue = worker(r), KEYS.queue(MODEL)
    need = {queue: Outranking(priority=1, aging_ms=1000, count=8)}  # none of theirs outranks priority 0
    # acme 7 (spare (7 - 1) / 3 = 2), globex 1: one more globex job is its share, a second would be above it
    due = await t.claim({queue: 8}, 8, need, {queue: BelowShare(2.0, {"acme": 7, "globex": 1})})
    first = {e.rid for e in due.entries}
    assert len(first) == 1 and first < set(probe) and due.left
    # globex running none beside acme's 10 (spare 3): three of its jobs stay within it
    due = await t.claim({queue: 8}, 8, need, {queue: BelowShare(3.0, {"acme": 10})})
    more = {e.rid for e in due.entries}
    assert len(more) == 3 and more < set(probe) - first and due.left


async def test_a_tenant_alone_uses_every_slot_and_one_back_from_idle_gets_no_credit(client: Client,
                                                                                    r: aredis.Redis) -> None:
    t = worker(r)
    await fill(client, "acme", 40)
    for _ in range(3):  # acme alone: the whole worker (work-conserving), its account grows
        runs = await claim(t, 8)
        assert [run.tenant for run in runs] == ["acme"] * 8
        for run in runs:
            await end(t, run, 10, 90)
    await claim(t, 8)  # a claim with acme backlogged sets the floor where a newcomer starts
    await fill(client, "globex", 20)
    acct = await r.hmget(KEYS.share(MODEL), ["acme", "globex"])  # type: ignore[misc]
    assert float(acct[1]) >= 2400.0  # lifted to acme's account, not left at 0 to take the worker over
    assert float(acct[1]) <= float(acct[0])


# --- caps ---------------------------------------------------------------------------------------------
async def test_max_running_holds_across_two_workers(client: Client, r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", max_running=2)
    await fill(client, "acme", 10)
    await fill(client, "globex", 10)
    w1, w2 = worker(r, "w1"), worker(r, "w2")
    runs1, runs2 = await asyncio.gather(claim(w1, 4), claim(w2, 4))
    runs = runs1 + runs2
    assert Counter(run.tenant for run in runs) == {"acme": 2, "globex": 6}
    assert await running_of(r, "acme") == 2
    acme = [run for run in runs if run.tenant == "acme"]
    await end(w1 if acme[0] in runs1 else w2, acme[0], 1, 1)
    assert await running_of(r, "acme") == 1
    more = Counter(run.tenant for run in await claim(w1, 4))
    assert more == {"acme": 1, "globex": 3}  # one of acme's ended: one more of its jobs, no more


async def test_a_dead_workers_running_jobs_stop_counting_once_their_leases_lapse(client: Client,
                                                                                 r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", max_running=2)
    await fill(client, "acme", 3)
    dead = worker(r, "dead", lease_s=0.2)
    assert len(await claim(dead, 8)) == 2
    reaper = worker(r, "reaper")
    assert await claim(reaper, 8) == []  # acme is at its cap
    await asyncio.sleep(0.4)  # the dead worker's leases lapse
    lost = await reaper.sweep()
    assert len(lost) == 2
    for job in lost:
        orphan = reaper.orphan(job)
        assert orphan.tenant == "acme"
        assert await reaper.write([Record(orphan, [orphan.reset("worker lost")], Write.HAND_BACK)]) == [True]
    assert await running_of(r, "acme") == 0
    assert await r.zcard(KEYS.queue(MODEL, "acme")) == 3  # handed back onto acme's queue
    assert len(await claim(reaper, 8)) == 2


async def test_max_queued_refuses_that_tenant_only(client: Client, r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", max_queued=2)
    await fill(client, "acme", 2)
    with pytest.raises(QueueFull, match="acme") as refused:
        await client.submit(model=MODEL, prompt="x", tenant="acme")
    assert refused.value.tenant == "acme" and refused.value.retry_after > 0
    await fill(client, "globex", 5)
    await tenants.remove(r, KEYS, "acme")  # its queued jobs stay, under the default policy: no cap
    await fill(client, "acme", 1)
    assert await r.zcard(KEYS.queue(MODEL, "acme")) == 3


async def test_tokens_per_minute_holds_a_tenants_jobs_queued_none_fails(client: Client, r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", tokens_per_minute=100)
    await fill(client, "acme", 4)
    t = worker(r)
    (first,) = await claim(t, 1)
    await end(t, first, 30, 90)  # 120 tokens this minute: over acme's 100
    await fill(client, "globex", 4)
    due = await t.claim({KEYS.queue(MODEL): 8}, 8)
    assert [t.run(e, MODEL, 0).tenant for e in due.entries] == ["globex"] * 4
    assert due.left and await r.zcard(KEYS.queue(MODEL, "acme")) == 3


async def test_a_job_is_charged_its_whole_prompt_the_part_its_worker_had_cached_too(client: Client,
                                                                                       r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", tokens_per_minute=100)
    await fill(client, "acme", 2)
    t = worker(r)
    (first,) = await claim(t, 1)
    events = [first.start(60, t.worker_id, cached_tokens=50), first.done(FinishReason.LENGTH, generated=60)]
    assert await t.write([Record(first, events, Write.END)]) == [True]
    (use,) = [u for u in await tenants.use(r, KEYS, {}) if u.name == "acme"]
    assert use.tokens_per_minute == pytest.approx(120, abs=2)  # over acme's 100: its next job waits
    assert not (await t.claim({KEYS.queue(MODEL): 1}, 1)).entries


async def test_tenants_lists_policy_and_live_use(client: Client, r: aredis.Redis) -> None:
    await tenants.store(r, KEYS, "acme", weight=3, max_running=4)
    await fill(client, "globex", 2)
    t = worker(r)
    runs = await claim(t, 1)
    await end(t, runs[0], 5, 5)
    use = {u.name: u for u in await tenants.use(r, KEYS, {"globex": 1})}
    assert use["acme"].policy == tenants.Policy(weight=3, max_running=4) and use["acme"].named
    assert not use["globex"].named and use["globex"].tokens_per_minute == pytest.approx(10, abs=1)
    assert use["globex"].share == 1.0
    with pytest.raises(BadRequest, match="weight"):
        await tenants.store(r, KEYS, "acme", weight=0)


async def test_an_idle_tenant_with_no_policy_is_listed_while_its_tokens_count_and_shares_sum_to_one(
        client: Client, r: aredis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    await tenants.store(r, KEYS, "acme", weight=2)
    await fill(client, "acme", 1)
    await fill(client, "globex", 1)  # no policy entry; idle once its job ends
    t = worker(r)
    for run in await claim(t, 2):
        await end(t, run, 10, 10)
    assert await r.hlen(KEYS.tenants_running()) == 0  # type: ignore[misc]  # nobody queued or running
    use = {u.name: u for u in await tenants.use(r, KEYS, {})}
    assert sorted(use) == ["acme", "globex"] and not use["globex"].named
    assert use["globex"].tokens_per_minute == pytest.approx(20, abs=1)
    assert sum(u.share for u in use.values()) == pytest.approx(1.0)
    monkeypatch.setenv("MLXQ_REDIS_URL", redis_url)
    assert await asyncio.to_thread(main, ["tenants"]) == 0  # the command runs its own event loop
    out = capsys.readouterr().out
    assert "globex*" in out and "(* no policy entry" in out


async def test_status_counts_jobs_running_as_of_now_for_workers_models_and_tenants_alike(client: Client,
                                                                                          r: aredis.Redis) -> None:
    from mlxq.api.schema import ModelState, ModelStatus, WorkerStatus
    from mlxq.api.status import collect

    await fill(client, "acme", 3)
    t = worker(r, "w1")
    runs = await claim(t, 3)
    now = time.time()  # w1's last heartbeat, while its three jobs ran (two in the batch, one waiting)
    record = WorkerStatus(id="w1", host="h", pid=1, version="v", started_at=now, updated_at=now,
                          models=[ModelStatus(name=MODEL, state=ModelState.SERVING, capacity=2, running=2, waiting=1)])
    await r.set(KEYS.worker("w1"), record.model_dump_json(), ex=30)
    await r.zadd(KEYS.workers(), {"w1": int(now * 1000)})
    for run in runs[:2]:  # two end before the next heartbeat
        await end(t, run, 5, 5)
    report = await collect(client)
    (acme,) = [u for u in report.tenants if u.name == "acme"]
    (m,) = report.workers[0].models
    assert acme.running == m.running + m.waiting == report.models[MODEL].running + report.models[MODEL].waiting == 1
    assert m.waiting == 1  # the record's waiting, as many as are claimed at most


async def test_shared_keys_have_a_ttl_and_an_idle_model_leaves_only_its_token_buckets(client: Client,
                                                                                      r: aredis.Redis) -> None:
    await fill(client, "acme", 1)  # one job: its end empties the running counts, then charges it
    t = worker(r)
    runs = await claim(t, 2)
    for key in (KEYS.backlog(MODEL), KEYS.share(MODEL), KEYS.tenants_running()):
        assert await r.ttl(key) > 0, key
    for run in runs:
        await end(t, run, 1, 1)
    assert all([await r.ttl(k) > 0 for k in await r.keys(f"{KEYS.prefix}:*")])  # the charge's writes included
    assert await claim(t, 2) == []  # a claim finds the model idle: its accounts go
    bucket = KEYS.tenant_tokens("acme", int(time.time() * 1000) // 60_000)
    left = {k.decode() for k in await r.keys(f"{KEYS.prefix}:*") if b"{" not in k}
    history = {k for k in left if k.startswith(f"{KEYS.prefix}:hist:") or k == KEYS.recent()}  # the dashboard's
    assert left - history == {KEYS.epoch(), bucket}
    assert 0 < await r.ttl(bucket) <= 120


# --- a real worker -------------------------------------------------------------------------------------
async def test_a_jobs_result_names_its_tenant(worker: RunningWorker, redis_url: str) -> None:
    async with Client(redis_url, tenant="acme") as c:
        result = await c.generate(model="tiny", prompt="hello", max_tokens=4, timeout=60)
    assert result.tenant == "acme"
    async with Client(redis_url) as c:
        assert (await c.generate(model="tiny", prompt="hello", max_tokens=4, timeout=60)).tenant == "default"


async def test_a_tenants_queued_jobs_expire_and_its_poison_entries_go_to_the_dead_letters(
        worker: RunningWorker, redis_url: str, r: aredis.Redis) -> None:
    async with Client(redis_url, tenant="acme") as c:
        rid = await c.submit(model="nobody", prompt="x", expires_in=0.2)  # no worker serves it
        with pytest.raises(JobFailed) as failed:
            await c.result(rid, timeout=30)
        assert failed.value.event.code is ErrorCode.EXPIRED
        assert await r.zcard(KEYS.queue("nobody", "acme")) == 0
        await r.zadd(KEYS.queue("tiny", "acme"), {"bad entry!": 1})
        await r.sadd(KEYS.backlog("tiny"), "acme")  # type: ignore[misc]
        assert (await c.generate(model="tiny", prompt="hi", max_tokens=3, timeout=60)).tenant == "acme"
    # (the entry is due first: the claim that started the job, or one before, moved it aside)
    (dead,) = [json.loads(d) for d in await r.lrange(KEYS.dead_letters(), 0, -1)]  # type: ignore[misc]
    assert dead["queue"] == KEYS.queue("tiny", "acme") and dead["entry"] == "bad entry!"

# --- the commands ------------------------------------------------------------------------------------------
def test_mlxq_tenants_sets_lists_and_removes_a_policy(redis_url: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLXQ_REDIS_URL", redis_url)
    assert main(["tenants", "set", "acme", "--weight", "3", "--max-running", "2"]) == 0
    assert main(["tenants", "set", "acme", "--max-queued", "50"]) == 0  # the other fields keep theirs
    assert "weight 3, max-running 2, max-queued 50" in capsys.readouterr().out
    for bad in (["--weight", "0"], ["--weight", "-1"], ["--max-running", "-2"]):
        assert main(["tenants", "set", "acme", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mlxq: "), err
    assert main(["tenants", "set", "bad name"]) == 2 and "name" in capsys.readouterr().err
    assert main(["tenants", "--json"]) == 0
    (acme,) = json.loads(capsys.readouterr().out)
    assert acme["name"] == "acme" and acme["policy"] == {"weight": 3.0, "max_running": 2, "max_queued": 50,
                                                         "tokens_per_minute": 0}
    out = (main(["tenants"]), capsys.readouterr().out)
    assert out[0] == 0 and "acme" in out[1] and "no policy entry" not in out[1]  # no row has a *: no footnote
    assert main(["status", "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)["tenants"]] == ["acme"]
    assert main(["tenants", "rm", "acme"]) == 0
    assert main(["tenants", "--json"]) == 0 and json.loads(capsys.readouterr().out.split("\n", 1)[1]) == []


async def test_metrics_show_each_tenants_jobs_tokens_wait_queue_and_running(worker_config: Any, redis_url: str,
                                                                            r: aredis.Redis) -> None:
    port = free_port()
    running = await start_worker(config_with(worker_config, metrics_port=port, metrics_addr="127.0.0.1"))
    try:
        async with Client(redis_url, tenant="acme") as c:
            done = await asyncio.gather(*(c.generate(model="tiny", prompt="hi", max_tokens=5, timeout=60)
                                          for _ in range(2)))
        await r.zadd(KEYS.queue("tiny", "globex"), {"parked": 10**15})  # queued, never due
        await r.sadd(KEYS.backlog("tiny"), "globex")  # type: ignore[misc]
        await running.host.health.beat()
        samples = await asyncio.to_thread(scrape, port)
        tiny_acme = {"model_name": "tiny", "tenant": "acme"}
        assert value(samples, "mlxq:tenant_requests_total", outcome="done", **tiny_acme) == 2
        assert value(samples, "mlxq:tenant_generation_tokens_total", **tiny_acme) == sum(
            d.usage.completion_tokens for d in done)
        assert value(samples, "mlxq:tenant_queue_time_seconds_count", **tiny_acme) == 2
        assert value(samples, "mlxq:tenant_queue_depth", model_name="tiny", tenant="globex") == 1
        assert ("mlxq:tenant_requests_running", (("tenant", "acme"),)) not in samples  # none running: no count
    finally:
        await running.close()
