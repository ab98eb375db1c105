"""CLAIM's prefix affinity on a real Redis: a worker prefers the queued jobs whose affinity key it advertises,
leaves one another live worker holds to it for at most the wait (and one nobody holds to a live worker holding
fewer keys), never waits for a lapsed (dead) holder nor for a full one, and never lets affinity reorder jobs of
different priority. A batch's lines (the bulk band) follow the worker holding their shared system prompt."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from mlxq.api.affinity import affinity_key, affinity_keys
from mlxq.api.batches import banded
from mlxq.api.client import Client
from mlxq.api.protocol.claim import Affinity, DueEntry, EntryStatus
from mlxq.api.protocol.emit import LogTTL
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import GenerateRequest
from mlxq.worker.affinity import Advertiser
from mlxq.worker.jobs.transitions import Transitions

pytestmark = pytest.mark.e2e

KEYS = Keys("mlxq")
MODEL = "m"
LONG_WAIT_MS = 60_000  # longer than any test: a job skipped for another holder stays skipped


def worker(r: aredis.Redis, name: str, wait_ms: int = LONG_WAIT_MS) -> Transitions:
    return Transitions(r, KEYS, name, LogTTL(), lease_ttl_s=30.0, affinity_wait_ms=wait_ms)


def key_of(conversation: str) -> str:
    return affinity_key(GenerateRequest(model=MODEL, prompt="x", prompt_cache_key=conversation))


async def advertise(r: aredis.Redis, name: str, *conversations: str, ttl_s: float = 30.0) -> Advertiser:
    adv = Advertiser(r, KEYS, name, ttl_s)
    adv.model(MODEL)  # a worker serving it with a prefix cache: listed even holding nothing
    for c in conversations:
        adv.started(MODEL, key_of(c), [1, 2, 3])
    await adv.write()
    return adv


async def submit(client: Client, conversation: str | None, **fields: object) -> str:
    """One job; the next one submitted is enqueued a later millisecond (jobs of one score go in id order, not
    enqueue order), so the queue holds them in submit order."""
    rid = await client.submit(model=MODEL, prompt="x", prompt_cache_key=conversation, **fields)
    await asyncio.sleep(0.002)
    return rid


async def claim(t: Transitions, n: int) -> tuple[list[DueEntry], bool]:
    due = await t.claim({KEYS.queue(MODEL): n}, n)
    return [e for e in due.entries if e.status is EntryStatus.STARTED], due.left


async def test_a_worker_takes_the_jobs_whose_key_it_holds_first(client: Client, r: aredis.Redis) -> None:
    a, b, c = [await submit(client, conv) for conv in ("a", "b", "c")]
    await advertise(r, "w1", "c")
    started, left = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(c, Affinity.HOLDER)] and left
    started, _ = await claim(worker(r, "w1"), 2)
    assert [(e.rid, e.affinity) for e in started] == [(a, Affinity.NONE), (b, Affinity.NONE)]


async def test_a_job_another_live_worker_holds_waits_for_it_then_anyone_takes_it(client: Client,
                                                                                  r: aredis.Redis) -> None:
    held, free = await submit(client, "held"), await submit(client, "free")
    await advertise(r, "w2", "held")
    started, left = await claim(worker(r, "w1"), 2)
    assert [e.rid for e in started] == [free] and left  # skipped, left queued: the next poll looks again
    assert await r.zscore(KEYS.queue(MODEL), held) is not None
    started, _ = await claim(worker(r, "w1", wait_ms=50), 2)  # the same job, once it waited past the bound
    if not started:  # claimed within 50 ms of its enqueue: look again after the bound
        await asyncio.sleep(0.1)
        started, _ = await claim(worker(r, "w1", wait_ms=50), 2)
    assert [(e.rid, e.affinity) for e in started] == [(held, Affinity.ELSEWHERE)]


async def test_the_holder_itself_takes_the_job_at_once(client: Client, r: aredis.Redis) -> None:
    held = await submit(client, "held")
    await advertise(r, "w2", "held")
    assert (await claim(worker(r, "w1"), 1))[0] == []
    started, _ = await claim(worker(r, "w2"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(held, Affinity.HOLDER)]


async def test_a_lapsed_holder_is_dead_and_a_stopped_one_withdrew(client: Client, r: aredis.Redis) -> None:
    one = await submit(client, "one")
    await advertise(r, "dead", "one", ttl_s=0.001)  # its advertisement lapsed: killed, frozen, or partitioned
    await asyncio.sleep(0.01)
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(one, Affinity.NONE)]
    assert await r.zcard(KEYS.affinity_advertisers(MODEL)) == 0  # CLAIM dropped the lapsed holder
    two = await submit(client, "two")
    stopped = await advertise(r, "stopped", "two")
    await stopped.remove()
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(two, Affinity.NONE)]


async def test_a_worker_listed_holding_nothing_counts_keyed_jobs_none_in_queue_order(client: Client,
                                                                                      r: aredis.Redis) -> None:
    keyed = await submit(client, "a")
    plain = await submit(client, None)
    await advertise(r, "w1")  # listed, no key: the one live advertiser holds nothing
    started, left = await claim(worker(r, "w1"), 2)
    assert [(e.rid, e.affinity) for e in started] == [(keyed, Affinity.NONE), (plain, None)] and not left


async def test_a_job_nobody_holds_waits_for_the_live_worker_holding_fewer_keys(client: Client,
                                                                                r: aredis.Redis) -> None:
    await advertise(r, "w1", "old")
    await advertise(r, "w2")  # live, holding nothing
    new = await submit(client, "new")
    started, left = await claim(worker(r, "w1"), 1)
    assert started == [] and left  # w2 is the one to take it: conversations spread over the fleet
    started, _ = await claim(worker(r, "w2"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(new, Affinity.NONE)]
    late = await submit(client, "late")
    await asyncio.sleep(0.1)
    started, _ = await claim(worker(r, "w1", wait_ms=50), 1)  # w2 did not take it within the wait: w1 does
    assert [(e.rid, e.affinity) for e in started] == [(late, Affinity.NONE)]


async def written(adv: Advertiser) -> None:
    """The full marks' changes handed over so far are written (or found unchanged)."""
    while adv._full_pending is not None:
        await asyncio.sleep(0.01)


async def test_a_full_holder_leaves_its_keys_jobs_to_another_worker_at_once(client: Client,
                                                                            r: aredis.Redis) -> None:
    held = await submit(client, "held")
    w2 = await advertise(r, "w2", "held")
    w2.set_full(MODEL, True)
    await written(w2)
    assert 0 < await r.pttl(KEYS.affinity_full(MODEL)) <= 30_000
    started, _ = await claim(worker(r, "w1"), 1)  # the wait is longer than the test: no waiting for w2
    assert [(e.rid, e.affinity) for e in started] == [(held, Affinity.ELSEWHERE)]
    w2.set_full(MODEL, False)  # freed: its keys' jobs wait for it again
    await written(w2)
    again = await submit(client, "held")
    started, left = await claim(worker(r, "w1"), 1)
    assert started == [] and left
    w3 = await advertise(r, "w3", "held")  # a second holder, full too: the job still goes at once
    w3.set_full(MODEL, True)
    w2.set_full(MODEL, True)
    await written(w2)
    await written(w3)
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(again, Affinity.ELSEWHERE)]
    await w2.remove()  # a stopped worker's mark goes with its advertisement
    assert [m.decode() for m in await r.zrange(KEYS.affinity_full(MODEL), 0, -1)] == ["w3"]


async def test_a_full_worker_holding_fewer_keys_does_not_hold_up_a_job_nobody_holds(client: Client,
                                                                                     r: aredis.Redis) -> None:
    await advertise(r, "w1", "old")
    w2 = await advertise(r, "w2")  # live, holding nothing, but full
    w2.set_full(MODEL, True)
    await written(w2)
    new = await submit(client, "new")
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(new, Affinity.NONE)]


async def test_the_full_mark_is_written_on_a_change_only_and_flapping_coalesces(r: aredis.Redis) -> None:
    adv = await advertise(r, "w1")
    adv.set_full(MODEL, False)  # as it was: nothing to write
    await written(adv)
    assert adv.full_writes == 0
    adv.set_full(MODEL, True)
    await written(adv)
    assert adv.full_writes == 1 and await r.zscore(KEYS.affinity_full(MODEL), "w1") is not None
    for _ in range(10):  # full and free again within the write interval: nothing changed to write
        adv.set_full(MODEL, False)
        adv.set_full(MODEL, True)
    await written(adv)
    assert adv.full_writes == 1
    adv.set_full(MODEL, False)
    await written(adv)
    assert adv.full_writes == 2 and await r.zscore(KEYS.affinity_full(MODEL), "w1") is None
    adv.set_full("unserved", True)  # a model it advertises nothing for: no mark
    await written(adv)
    assert adv.full_writes == 2


async def test_affinity_never_jumps_a_job_of_higher_priority(client: Client, r: aredis.Redis) -> None:
    mine = await submit(client, "mine", priority=0)
    urgent = await submit(client, None, priority=5)
    later = await submit(client, "other", priority=0)
    await advertise(r, "w1", "mine")
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(urgent, None)]  # no key: nothing to place
    started, _ = await claim(worker(r, "w1"), 2)
    assert [(e.rid, e.affinity) for e in started] == [(mine, Affinity.HOLDER), (later, Affinity.NONE)]


async def test_a_batchs_lines_follow_the_worker_holding_their_system_prompt(client: Client,
                                                                              r: aredis.Redis) -> None:
    system = "You label support tickets by their topic. " * 20  # long: a key of its own (api/affinity.py)

    def line(n: int, question: str, *turns: dict[str, str]) -> GenerateRequest:
        req = GenerateRequest(model=MODEL, messages=[*turns, {"role": "user", "content": question}])
        return banded(req, f"batch_aff.L{n}", "default", None)  # as the feeder submits it: the bulk band

    labelled = [line(n, q, {"role": "system", "content": system}) for n, q in enumerate(("a refund?", "a bug"))]
    other = line(2, "unrelated")
    for req in (*labelled, other):
        await client.submit(req)
        await asyncio.sleep(0.002)
    adv = Advertiser(r, KEYS, "w2", 30.0)
    adv.started(MODEL, affinity_keys(labelled[0])[1:], [1, 2, 3])  # w2 has the system prompt warm
    await adv.write()
    both = {KEYS.queue(MODEL): 3, KEYS.queue(MODEL, bulk=True): 3}
    due = await worker(r, "w1").claim(both, 3)
    assert [e.rid for e in due.entries if e.status is EntryStatus.STARTED] == [other.id] and due.left
    due = await worker(r, "w2").claim(both, 3)
    started = [(e.rid, e.affinity, e.bulk) for e in due.entries if e.status is EntryStatus.STARTED]
    assert started == [(req.id, Affinity.HOLDER, True) for req in labelled]


async def test_affinity_off_keeps_the_queue_order(client: Client, r: aredis.Redis) -> None:
    ids = [await submit(client, conv) for conv in ("a", "b")]
    await advertise(r, "w1", "b")
    await advertise(r, "w2", "a")
    started, _ = await claim(worker(r, "w1", wait_ms=-1), 2)
    assert [(e.rid, e.affinity) for e in started] == [(ids[0], None), (ids[1], None)]


async def test_the_advertisement_has_a_ttl_and_is_bounded(r: aredis.Redis) -> None:
    adv = Advertiser(r, KEYS, "w1", 5.0)
    holdings = adv.model(MODEL)
    holdings.max_keys = 3
    for i in range(5):
        adv.started(MODEL, key_of(f"c{i}"), [i])
        adv.holdings[MODEL].ended(key_of(f"c{i}"))
    await adv.write()
    members = {m.decode() for m in await r.smembers(KEYS.affinity_keys(MODEL, "w1"))}  # type: ignore[misc]
    assert members == {key_of(f"c{i}") for i in (2, 3, 4)}
    assert 0 < await r.pttl(KEYS.affinity_keys(MODEL, "w1")) <= 5000
    assert 0 < await r.pttl(KEYS.affinity_advertisers(MODEL)) <= 5000
    holdings.keep(holdings.idle(), [True, False, True])  # the cache evicted c3's prompt
    await adv.write()
    members = {m.decode() for m in await r.smembers(KEYS.affinity_keys(MODEL, "w1"))}  # type: ignore[misc]
    assert members == {key_of("c2"), key_of("c4")}
