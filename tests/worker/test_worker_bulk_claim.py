"""CLAIM's bulk band on a real Redis (api/protocol/lua/bulk.lua): a model's bulk jobs start only on the room its
interactive jobs leave, aging in the queue never lifts one above an interactive job, the fair share holds between
tenants within the band, and a worker's claim passes its bulk queue with the room its interactive one has."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.protocol.claim import DueEntry, EntryStatus
from mlxq.api.protocol.emit import LogTTL
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import PRIORITY_MAX, PRIORITY_MIN
from mlxq.worker.jobs.transitions import Transitions

pytestmark = pytest.mark.e2e

KEYS = Keys("mlxq")
MODEL = "m"


async def submit(client: Client, **fields: object) -> str:
    """One job; the next one is enqueued a later millisecond, so a queue holds them in submit order."""
    rid = await client.submit(model=MODEL, prompt="x", **fields)
    await asyncio.sleep(0.002)
    return rid


async def claim(r: aredis.Redis, n: int) -> tuple[list[DueEntry], bool]:
    """A worker's claim of up to ``n`` jobs of the model, both bands with the same room (as worker/host.py)."""
    t = Transitions(r, KEYS, "w1", LogTTL(), lease_ttl_s=30.0, affinity_wait_ms=-1)
    due = await t.claim({KEYS.queue(MODEL, bulk=True): n, KEYS.queue(MODEL): n}, n)  # the order given is not kept
    return [e for e in due.entries if e.status is EntryStatus.STARTED], due.left


async def test_bulk_jobs_take_only_the_room_interactive_jobs_leave(client: Client, r: aredis.Redis) -> None:
    bulk = [await submit(client, bulk=True) for _ in range(4)]  # queued first: older than the interactive ones
    inter = [await submit(client, priority=PRIORITY_MIN) for _ in range(3)]
    started, left = await claim(r, 2)
    assert [e.rid for e in started] == inter[:2] and left  # interactive jobs wait: no bulk job starts
    started, left = await claim(r, 3)
    assert [e.rid for e in started] == [inter[2], *bulk[:2]] and left  # the rest of the room: bulk, oldest first
    assert {e.queue for e in started[1:]} == {KEYS.queue(MODEL, bulk=True)}
    started, left = await claim(r, 5)
    assert [e.rid for e in started] == bulk[2:] and not left
    assert await r.zcard(KEYS.queue(MODEL, bulk=True)) == 0
    assert await r.hget(KEYS.running(), bulk[0]) is not None  # listed running, from its own queue
    assert (await r.hget(KEYS.running(), bulk[0])).decode().endswith(" " + KEYS.queue(MODEL, bulk=True))


async def test_aging_never_lifts_a_bulk_job_above_an_interactive_one(redis_url: str, r: aredis.Redis) -> None:
    # The bulk job has the highest priority and has waited 200 levels' worth: the interactive job of the lowest
    # priority, fresh, still goes first; and the bulk job then goes to the room left.
    async with Client(redis_url, config=ClientConfig(priority_aging_s=0.001)) as client:
        old = await submit(client, bulk=True, priority=PRIORITY_MAX)
        await asyncio.sleep(0.3)
        fresh = await submit(client, priority=PRIORITY_MIN)
    started, left = await claim(r, 1)
    assert [e.rid for e in started] == [fresh] and left
    started, _ = await claim(r, 1)
    assert [e.rid for e in started] == [old]


async def test_the_fair_share_holds_between_tenants_within_the_bulk_band(client: Client, r: aredis.Redis) -> None:
    await client.set_tenant("heavy", weight=3)
    heavy = [await submit(client, bulk=True, tenant="heavy") for _ in range(6)]
    light = [await submit(client, bulk=True, tenant="light") for _ in range(6)]
    started, _ = await claim(r, 4)
    tenants = [e.tenant for e in started]
    assert tenants.count("heavy") == 3 and tenants.count("light") == 1  # by weight, though heavy queued first
    assert [e.rid for e in started if e.tenant == "heavy"] == heavy[:3] and light[0] in {e.rid for e in started}
    # its own accounts: the bulk band's running counts, none charged to the model's interactive share
    share = await r.hgetall(KEYS.share(MODEL + "~bulk"))
    assert int(share[b"heavy:r"]) == 3 and int(share[b"light:r"]) == 1 and int(share[b"~r"]) == 4
    assert not await r.exists(KEYS.share(MODEL))


async def test_a_capped_tenants_interactive_jobs_leave_the_room_to_bulk_jobs(client: Client,
                                                                            r: aredis.Redis) -> None:
    # Its interactive jobs could not be taken (its max_running is reached): the room is idle, and bulk fills it.
    await client.set_tenant("capped", max_running=1)
    first = await submit(client, tenant="capped")
    started, _ = await claim(r, 1)
    assert [e.rid for e in started] == [first]
    await submit(client, tenant="capped")
    bulk = await submit(client, bulk=True)
    started, left = await claim(r, 2)
    assert [e.rid for e in started] == [bulk] and left


@pytest.mark.parametrize("name", ["m", "m~bulk", "org/model-7B:q4~bulk", "~bulk", "m~bulk~bulk", "m~bul"])
async def test_the_lua_band_of_a_name_is_keys_model_band(r: aredis.Redis, name: str) -> None:
    from mlxq.api.protocol.keys import model_band
    from mlxq.api.protocol.scripts import Layout, compose

    probe = "--#include queues\nlocal m, b = band_of(name)\nreturn {m, b and 1 or 0}\n"
    m, b = await compose("probe", probe, Layout(args=("name",))).run(r, {}, {"name": name})
    assert (m.decode(), bool(b)) == model_band(name)


async def test_a_claim_says_whether_the_jobs_it_left_queued_are_interactive_ones(client: Client,
                                                                                r: aredis.Redis) -> None:
    # A worker claims again for queued interactive jobs as soon as an engine has room (worker/host.py); bulk jobs
    # left queued wait for a job's end, as ever.
    t = Transitions(r, KEYS, "w1", LogTTL(), lease_ttl_s=30.0, affinity_wait_ms=-1)
    quotas = {KEYS.queue(MODEL): 1, KEYS.queue(MODEL, bulk=True): 1}
    inter = [await submit(client) for _ in range(2)]
    await submit(client, bulk=True)
    due = await t.claim(quotas, 1)
    assert [e.rid for e in due.entries] == inter[:1] and due.left and due.left_interactive
    due = await t.claim(quotas, 1)
    assert [e.rid for e in due.entries] == inter[1:] and due.left and not due.left_interactive  # a bulk job
    due = await t.claim(quotas, 1)
    assert len(due.entries) == 1 and not due.left and not due.left_interactive
