"""CLAIM on a real Redis spreads jobs whose affinity key no live worker holds (new conversations) over the live
workers with room: a call takes at most its share of them while others could take the rest, for at most the wait;
a lone worker, one whose others are full, and one facing a queue deeper than it read take them all, and jobs
without a key and the jobs a worker holds are taken as ever."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.protocol.claim import Affinity
from tests.worker.test_worker_affinity_claim import KEYS, MODEL, advertise, claim, key_of, submit, worker, written

pytestmark = pytest.mark.e2e


async def test_new_conversations_spread_over_the_live_workers_with_room(client: Client, r: aredis.Redis) -> None:
    ids = [await submit(client, f"new-{i}") for i in range(6)]
    await advertise(r, "w1")
    await advertise(r, "w2")  # both live, holding nothing, with room
    started, left = await claim(worker(r, "w1"), 6)
    assert [(e.rid, e.affinity) for e in started] == [(rid, Affinity.NONE) for rid in ids[:3]] and left
    started, left = await claim(worker(r, "w2"), 6)
    assert [e.rid for e in started] == ids[3:] and not left


async def test_a_worker_alone_or_beside_full_ones_takes_every_new_conversation(client: Client,
                                                                               r: aredis.Redis) -> None:
    ids = [await submit(client, f"new-{i}") for i in range(6)]
    await advertise(r, "w1")
    started, _ = await claim(worker(r, "w1"), 6)
    assert [e.rid for e in started] == ids
    ids = [await submit(client, f"next-{i}") for i in range(6)]
    w2 = await advertise(r, "w2")
    w2.set_full(MODEL, True)
    await written(w2)
    started, _ = await claim(worker(r, "w1"), 6)
    assert [e.rid for e in started] == ids


async def test_jobs_past_the_share_wait_at_most_the_bound(client: Client, r: aredis.Redis) -> None:
    ids = [await submit(client, f"new-{i}") for i in range(4)]
    await advertise(r, "w1")
    await advertise(r, "w2")
    await asyncio.sleep(0.1)
    started, _ = await claim(worker(r, "w1", wait_ms=50), 4)  # every one waited past the bound: no share
    assert [e.rid for e in started] == ids


async def test_the_share_leaves_held_and_keyless_jobs_as_they_were(client: Client, r: aredis.Redis) -> None:
    mine = await submit(client, "mine")
    fresh = [await submit(client, f"new-{i}") for i in range(4)]
    plain = [await submit(client, None) for _ in range(2)]
    await advertise(r, "w1", "mine")
    await advertise(r, "w2", "theirs")  # as many keys: neither is the one to take new conversations
    started, left = await claim(worker(r, "w1"), 7)
    assert [(e.rid, e.affinity) for e in started] == [(mine, Affinity.HOLDER), *[(rid, Affinity.NONE) for rid in
                                                      fresh[:2]], *[(rid, None) for rid in plain]] and left


async def test_a_queue_deeper_than_the_read_is_claimed_as_ever(client: Client, r: aredis.Redis) -> None:
    ids = [await submit(client, f"new-{i}") for i in range(20)]
    for name in ("w1", "w2", "w3"):
        await advertise(r, name)
    started, _ = await claim(worker(r, "w1"), 8)  # reads 16 of 20: every worker's room is taken anyway
    assert [e.rid for e in started] == ids[:8]
    started, _ = await claim(worker(r, "w2"), 8)  # 12 left, all read: w1 advertises 8 keys now, so half of them
    assert [e.rid for e in started] == ids[8:14]


async def test_a_started_jobs_keys_are_advertised_at_once(client: Client, r: aredis.Redis) -> None:
    await submit(client, "a")
    await submit(client, "b")
    await advertise(r, "w1", ttl_s=5.0)
    await advertise(r, "w3", "c")  # another advertiser: the claims count what w1 holds
    started, _ = await claim(worker(r, "w1"), 1)
    assert len(started) == 1
    own = KEYS.affinity_keys(MODEL, "w1")
    assert await r.smembers(own) == {key_of("a").encode()}  # type: ignore[misc]
    assert 0 < await r.pttl(own) <= 5000  # it lapses with the advertisement
    started, _ = await claim(worker(r, "w2"), 1)  # not advertising (no prefix cache): nothing written for it
    assert len(started) == 1 and not await r.exists(KEYS.affinity_keys(MODEL, "w2"))
