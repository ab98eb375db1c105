"""CLAIM's prefix affinity at several depths, on a real Redis: a chat job with a long system prompt carries its
conversation's key and its system prompt's (api/affinity.py); a worker holding only the system prompt takes the
single-turn jobs that share it while others wait for it, and the deepest key a live worker able to take the job
holds decides (a conversation's holder keeps its next turn though others hold its system prompt)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from mlxq.api.affinity import affinity_keys
from mlxq.api.client import Client
from mlxq.api.protocol.claim import Affinity
from mlxq.api.schema import GenerateRequest
from tests.worker.test_worker_affinity_claim import KEYS, MODEL, Advertiser, claim, worker, written

pytestmark = pytest.mark.e2e

SYSTEM = "You answer questions about a job queue that routes requests by their prompts' cache. " * 16


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def keys_of(messages: list[dict[str, str]]) -> tuple[str, ...]:
    return affinity_keys(GenerateRequest(model=MODEL, messages=messages))  # type: ignore[arg-type]


async def submit(client: Client, messages: list[dict[str, str]]) -> str:
    rid = await client.submit(model=MODEL, messages=messages)
    await asyncio.sleep(0.002)  # the next one a later millisecond: the queue holds them in submit order
    return rid


async def holding(r: aredis.Redis, name: str, *keys: str) -> Advertiser:
    adv = Advertiser(r, KEYS, name, 30.0)
    adv.model(MODEL)
    for k in keys:
        adv.started(MODEL, k, [1, 2, 3])
    await adv.write()
    return adv


async def test_a_single_turn_job_goes_to_the_worker_holding_its_system_prompt(client: Client,
                                                                              r: aredis.Redis) -> None:
    first = chat(SYSTEM, "What is a lease?")
    deep, system = keys_of(first)
    later = chat(SYSTEM, "What is a tenant?")  # another single-turn request: only the system prompt in common
    assert keys_of(later)[1] == system and keys_of(later)[0] != deep
    await holding(r, "w1", deep, system)
    await holding(r, "w2", "00" * 8)  # live, holding something else
    job = await submit(client, later)
    started, left = await claim(worker(r, "w2"), 1)
    assert started == [] and left  # left to w1, which holds its system prompt
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(job, Affinity.HOLDER)]


async def test_the_deepest_held_key_wins_over_a_shared_system_prompt(client: Client, r: aredis.Redis) -> None:
    one, two = chat(SYSTEM, "Conversation one?"), chat(SYSTEM, "Conversation two?")
    (deep_one, system), (deep_two, _) = keys_of(one), keys_of(two)
    await holding(r, "w1", deep_one, system)  # both hold the system prompt; each its own conversation
    await holding(r, "w2", deep_two, system)
    next_two = await submit(client, [*two, {"role": "assistant", "content": "Yes."},
                                     {"role": "user", "content": "And then?"}])
    next_one = await submit(client, [*one, {"role": "assistant", "content": "Yes."},
                                     {"role": "user", "content": "And then?"}])
    started, left = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(next_one, Affinity.HOLDER)] and left  # passed next_two
    started, left = await claim(worker(r, "w1"), 1)
    assert started == [] and left  # conversation two's holder is live: its turn waits for it
    started, _ = await claim(worker(r, "w2"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(next_two, Affinity.HOLDER)]


async def test_a_full_deep_holder_leaves_the_job_to_the_system_prompts_holder(client: Client,
                                                                              r: aredis.Redis) -> None:
    first = chat(SYSTEM, "Conversation three?")
    deep, system = keys_of(first)
    full = await holding(r, "w2", deep, system)
    full.set_full(MODEL, True)
    await written(full)
    await holding(r, "w1", system)
    await holding(r, "w3")  # live, holding nothing
    job = await submit(client, [*first, {"role": "assistant", "content": "Yes."},
                                {"role": "user", "content": "And then?"}])
    started, left = await claim(worker(r, "w3"), 1)
    assert started == [] and left  # not to anyone: w1 holds its system prompt and can take it
    started, _ = await claim(worker(r, "w1"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(job, Affinity.HOLDER)]


async def test_a_short_system_prompt_gets_no_key_of_its_own_and_placement_is_as_before(client: Client,
                                                                                        r: aredis.Redis) -> None:
    short = chat("You are brief.", "What is a lease?")
    assert len(keys_of(short)) == 1
    await holding(r, "w1", keys_of(chat("You are brief.", "Something else?"))[0])
    await holding(r, "w2")  # live, holding nothing: fewer keys, so a job nobody holds waits for it
    job = await submit(client, short)
    started, left = await claim(worker(r, "w1"), 1)
    assert started == [] and left
    started, _ = await claim(worker(r, "w2"), 1)
    assert [(e.rid, e.affinity) for e in started] == [(job, Affinity.NONE)]
