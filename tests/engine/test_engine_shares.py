"""Groups (a worker's tenants) sharing the batch by weight: who takes whose place, driven step by step over the
toy batch (tests/engine/fakes.py); a preempted sequence resumes and generates what it would have unpreempted."""

from __future__ import annotations

import pytest

from mlxq.engine.core.request import EngineRequest, FinishReason
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.core.shares import GroupShare, Shares
from tests.engine.fakes import Clock, Run, ToyBatch, req, scheduler, toy_generate, waiting

pytestmark = pytest.mark.unit


def prompt(i: int) -> list[int]:
    return [i % 7 + 1, i % 5 + 2]


def add(s: Scheduler, rid: str, group: str, i: int, *, max_tokens: int = 10, weight: float = 1.0,
        priority: int = 0, arrival: float = 0.0) -> EngineRequest:
    r = req(rid, prompt(i), max_tokens=max_tokens, group=group, weight=weight, priority=priority, arrival=arrival)
    s.add(r)
    return r


def assert_exact(run: Run, reqs: list[EngineRequest]) -> None:
    for r in reqs:
        n = r.params.max_tokens
        assert run.tokens(r.rid) == toy_generate(r.prompt_tokens, n), r.rid  # no gap, no repeat, no restart
        assert run.final(r.rid).finish is FinishReason.LENGTH and run.final(r.rid).completion_tokens == n
        assert run.started_order.count(r.rid) == 1, r.rid


def test_a_group_below_its_share_takes_the_place_of_a_group_above_it_and_everyone_continues() -> None:
    clock = Clock(10.0)
    s = scheduler(ToyBatch(), capacity=2, clock=clock)
    run = Run()
    a = [add(s, f"a{i}", "a", i, arrival=10.0 + i / 10) for i in range(3)]  # a2 waits: a fills the batch
    run.step(s, 3)
    b = add(s, "b0", "b", 9, max_tokens=4, arrival=11.0)  # arrived after a2, of the same priority
    run.step(s)  # b0 starts at once (a's load 2 - 1 >= b's 0 + 1), before a2 that waited longer
    assert run.tokens("b0") == toy_generate(b.prompt_tokens, 1)
    run.step(s)  # a1, the latest of a's, leaves at the start of the next step
    assert run.started_order == ["a0", "a1", "b0"] and s.stats.preemptions == 1
    assert set(waiting(s)) == {"a1", "a2"}
    run.drain(s)
    assert run.started_order == ["a0", "a1", "b0", "a2"]
    assert_exact(run, [*a, b])
    assert s.stats.preemptions == 1 and s.stats.resumes == 1


def test_a_group_below_its_share_starts_at_once_in_a_free_slot_not_with_the_others_joining() -> None:
    # A flood's jobs refill the slots they free together: one of a light group joining then is prefilled on its
    # own and has its first token in the step it joins, instead of being prefilled with the flood's.
    s = scheduler(ToyBatch(), capacity=4, clock=Clock(10.0))
    run = Run()
    a = [add(s, f"a{i}", "a", i, max_tokens=6, arrival=10.0 + i / 10) for i in range(2)]
    run.step(s, 2)
    more = [add(s, f"a{i}", "a", i, max_tokens=6, arrival=10.0 + i / 10) for i in (2, 3)]  # queued before b0
    b = add(s, "b0", "b", 9, max_tokens=4, arrival=11.0)  # a's load 2 - 1 >= b's 0 + 1: below its share
    run.step(s)
    assert run.tokens("b0") == toy_generate(b.prompt_tokens, 1)  # its first token, in the step it joined
    assert s.stats.started_at_once == 1 and s.stats.preemptions == 0
    assert all(run.tokens(r.rid) == [] for r in more)  # they joined the batch as usual
    run.drain(s)
    assert_exact(run, [*a, *more, b])


def test_a_group_at_its_share_joins_a_free_slot_as_usual() -> None:
    s = scheduler(ToyBatch(), capacity=3, clock=Clock(10.0))
    run = Run()
    a = add(s, "a0", "a", 1, max_tokens=6, arrival=10.0)
    b = add(s, "b0", "b", 2, max_tokens=6, arrival=10.1)
    run.step(s, 2)
    late = add(s, "b1", "b", 3, max_tokens=4, arrival=10.2)  # a's spare 0 < b's load after it, 2
    run.drain(s)
    assert s.stats.started_at_once == 0 and s.stats.preemptions == 0
    assert_exact(run, [a, b, late])


def test_equal_loads_never_preempt_across_groups_and_priority_reaches_only_its_own_group() -> None:
    s = scheduler(ToyBatch(), capacity=2, clock=Clock(10.0))
    run = Run()
    a = add(s, "a0", "a", 1, max_tokens=8, arrival=10.0)
    b = add(s, "b0", "b", 2, max_tokens=8, arrival=10.1)
    run.step(s, 2)
    late = add(s, "b1", "b", 3, max_tokens=3, arrival=10.2)  # b at its share: waits
    run.step(s, 2)
    assert s.stats.preemptions == 0 and run.started_order == ["a0", "b0"]
    vip = add(s, "b2", "b", 4, max_tokens=3, priority=5, arrival=10.3)  # outranks a0, but a is not above its share
    run.step(s, 2)
    assert s.stats.preemptions == 1 and run.started_order == ["a0", "b0", "b2"]  # it took b0's place, not a0's
    assert "a0" not in waiting(s)
    run.drain(s)
    assert_exact(run, [a, b, late, vip])


def test_weights_set_the_share_a_group_keeps() -> None:
    s = scheduler(ToyBatch(), capacity=4, clock=Clock(10.0))
    run = Run()
    heavy = [add(s, f"a{i}", "a", i, weight=3.0, max_tokens=12, arrival=10.0) for i in range(4)]
    run.step(s, 2)
    light = [add(s, f"b{i}", "b", 10 + i, max_tokens=12, arrival=10.5) for i in range(2)]
    run.step(s, 3)
    # a (weight 3) with 4 running: (4 - 1) / 3 = 1 >= b's (0 + 1) / 1, so b0 takes one place; then a with 3:
    # (3 - 1) / 3 < (1 + 1) / 1, so b1 waits for a slot.
    assert s.stats.preemptions == 1 and run.started_order == ["a0", "a1", "a2", "a3", "b0"]
    run.drain(s)
    assert_exact(run, [*heavy, *light])


def test_a_request_below_its_share_is_not_held_back_by_a_preempted_one_ahead_of_it() -> None:
    s = scheduler(ToyBatch(), capacity=4, clock=Clock(10.0))
    run = Run()
    a = [add(s, f"a{i}", "a", i, max_tokens=14, arrival=10.0) for i in range(4)]
    run.step(s, 2)
    b0 = add(s, "b0", "b", 8, max_tokens=12, arrival=11.0)
    run.step(s, 2)  # a3 preempted: it waits at the head of the queue (it arrived first)
    assert s.stats.preemptions == 1 and len(waiting(s)) == 1
    b1 = add(s, "b1", "b", 9, max_tokens=12, arrival=12.0)  # behind a3; a's load (3 - 1) >= b's (1 + 1)
    run.step(s, 2)
    assert run.started_order == ["a0", "a1", "a2", "a3", "b0", "b1"] and s.stats.preemptions == 2
    run.drain(s)
    assert_exact(run, [*a, b0, b1])


def test_one_group_keeps_priority_preemption_as_it_was() -> None:
    s = scheduler(ToyBatch(), capacity=1, clock=Clock(10.0))
    run = Run()
    low = add(s, "low", "", 1, max_tokens=8, arrival=10.0)
    run.step(s, 2)
    same = add(s, "same", "", 2, max_tokens=2, arrival=10.1)
    run.step(s, 2)
    assert s.stats.preemptions == 0
    high = add(s, "high", "", 3, max_tokens=2, priority=1, arrival=10.2)
    run.drain(s)
    assert s.stats.preemptions == 1 and run.started_order == ["low", "high", "same"]
    assert_exact(run, [low, same, high])


def test_the_room_shows_each_running_groups_part_with_its_unstarted_requests_queued() -> None:
    s = scheduler(ToyBatch(), capacity=3, clock=Clock(10.0))
    run = Run()
    for i in range(2):
        add(s, f"a{i}", "a", i, max_tokens=10, weight=2.0)
    add(s, "b0", "b", 5, max_tokens=10)
    run.step(s)
    assert set(s.room.groups) == {GroupShare("a", 2, 2.0), GroupShare("b", 1, 1.0)}
    assert GroupShare("a", 2, 2.0).spare == 0.5
    add(s, "a2", "a", 3, max_tokens=10, weight=2.0)  # waits, unstarted: counted as its group's, not running
    add(s, "c0", "c", 4, max_tokens=10)  # a group with none running shows too (its spare is never used)
    run.step(s)
    assert set(s.room.groups) == {GroupShare("a", 2, 2.0, queued=1), GroupShare("b", 1, 1.0),
                                  GroupShare("c", 0, 1.0, queued=1)}
    assert len(waiting(s)) == 2 and GroupShare("a", 2, 2.0, queued=1).taken == 3
    assert s.room.outranked is None  # a priority is outranked only while nothing unstarted waits
    run.drain(s)
    assert s.room.groups == ()


def test_shares_count_running_and_waiting_groups() -> None:
    shares = Shares()
    a, b = req("a", group="a", weight=2.0), req("b", group="b")
    for _ in range(3):
        shares.join(a)
    assert shares.load_after(b) == 1.0 and shares.spare("a") == 1.0 and shares.below(b)
    assert shares.yields_to(a, b) and shares.yields_to(a, b, taken=1) is False  # (3 - 2) / 2 < 1
    assert not shares.below(a)  # its own group is never above it
    shares.wait(a)
    assert not shares.mixed
    shares.wait(b)
    assert shares.mixed
    shares.unwait(b)
    for _ in range(3):
        shares.leave(a)
    assert not shares.running and not shares.weights and not shares.mixed
