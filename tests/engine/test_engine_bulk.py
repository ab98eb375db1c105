"""The bulk band in the engine (``EngineRequest.bulk``), driven step by step over the toy batch
(tests/engine/fakes.py): aging never lifts a bulk request above another, any request of higher priority takes a
bulk row's place at once whatever its group, the bulk row resumes exactly, and a bulk request preempts nobody."""

from __future__ import annotations

import pytest

from mlxq.engine.core.request import EngineRequest, FinishReason
from mlxq.engine.core.waiting import BULK_BAND_S, priority_key
from tests.engine.fakes import Clock, Run, ToyBatch, req, scheduler, toy_generate, waiting

pytestmark = pytest.mark.unit

BULK = -101  # the worker's engine priority of a bulk job (worker/jobs/translate.py: PRIORITY_MIN - 1)


def bulk(rid: str, prompt: list[int] | int = 3, max_tokens: int = 8, **kw: object) -> EngineRequest:
    return req(rid, prompt, max_tokens, priority=BULK, bulk=True, **kw)  # type: ignore[arg-type]


def assert_exact(run: Run, reqs: list[EngineRequest]) -> None:
    for r in reqs:
        n = r.params.max_tokens
        assert run.tokens(r.rid) == toy_generate(r.prompt_tokens, n), r.rid  # no gap, no repeat, no restart
        assert run.final(r.rid).finish is FinishReason.LENGTH and run.final(r.rid).completion_tokens == n
        assert [o.finish is not None for o in run.outputs[r.rid]].count(True) == 1, r.rid  # one end
        assert run.started_order.count(r.rid) == 1, r.rid


def test_a_bulk_key_is_behind_any_wait_and_priority() -> None:
    waited_long = priority_key(0.0, BULK, 1.0, bulk=True)
    fresh_lowest = priority_key(1e6, -100, 1.0)  # ~11 days later, the lowest interactive priority
    assert fresh_lowest < waited_long < fresh_lowest + BULK_BAND_S
    assert priority_key(5.0, BULK, 1.0, bulk=True) > waited_long  # among bulk: first come first served


def test_a_long_waiting_bulk_request_is_admitted_after_a_fresh_one_of_the_lowest_priority() -> None:
    s = scheduler(ToyBatch(), capacity=1, clock=Clock(1000.0), aging_s=1.0)
    run = Run()
    s.add(bulk("old bulk", max_tokens=1, arrival=0.0))  # waited 1000 s: 1000 levels' worth of aging
    s.add(req("fresh", max_tokens=1, priority=-100, arrival=1000.0))
    run.drain(s)
    assert run.started_order == ["fresh", "old bulk"]


def test_an_interactive_request_takes_a_bulk_rows_place_at_once_and_the_bulk_row_resumes_exactly() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=2, clock=Clock(10.0))
    run = Run()
    rows = [bulk("b0", [1, 2], max_tokens=10, arrival=1.0), bulk("b1", [3, 4], max_tokens=10, arrival=2.0)]
    for r in rows:
        s.add(r)
    run.step(s, 3)
    vip = req("vip", [5], max_tokens=4, priority=-100, arrival=10.0)  # the lowest interactive priority
    s.add(vip)
    run.step(s)
    assert run.tokens("vip") == toy_generate([5], 1)  # its first token in the step that admitted it
    run.step(s)
    assert s.stats.preemptions == 1 and waiting(s) == ["b1"]  # the latest bulk row stepped aside
    run.drain(s)
    assert_exact(run, [*rows, vip])
    assert (s.stats.resumes, s.stats.recomputes) == (1, 0)


def test_a_bulk_row_of_another_group_gives_way_to_priority_whatever_the_share() -> None:
    # Between groups the share decides, except for bulk rows: group b's job below b's share or not, a's bulk
    # rows hold no place against it.
    s = scheduler(ToyBatch(), capacity=2, clock=Clock(10.0))
    run = Run()
    rows = [bulk("a0", [1, 2], max_tokens=10, group="a", arrival=1.0),
            req("b0", [3, 4], max_tokens=10, group="b", arrival=2.0)]
    for r in rows:
        s.add(r)
    run.step(s, 2)
    vip = req("b1", [5], max_tokens=3, group="b", arrival=10.0)  # b would be above its share with it
    s.add(vip)
    run.step(s, 2)
    assert s.stats.preemptions == 1 and waiting(s) == ["a0"]
    run.drain(s)
    assert_exact(run, [*rows, vip])


def test_a_bulk_request_preempts_nobody_not_even_for_its_groups_share() -> None:
    s = scheduler(ToyBatch(), capacity=2, clock=Clock(10.0))
    run = Run()
    rows = [req("a0", [1], max_tokens=6, group="a", arrival=1.0), req("a1", [2], max_tokens=6, group="a", arrival=2.0)]
    for r in rows:
        s.add(r)
    run.step(s, 2)
    late = bulk("b0", [3], max_tokens=3, group="b", arrival=3.0)  # b is far below its share: still it waits
    s.add(late)
    run.step(s, 2)
    assert s.stats.preemptions == 0 and waiting(s) == ["b0"]
    run.drain(s)
    assert_exact(run, [*rows, late])
    assert run.started_order == ["a0", "a1", "b0"]


def test_beside_an_interactive_row_a_step_admits_one_bulk_request() -> None:
    # Each bulk prompt joining is a prefill in the next steps: one a step keeps every step short for the
    # interactive rows (and for an interactive request arriving meanwhile).
    s = scheduler(ToyBatch(), capacity=6, clock=Clock(10.0))
    run = Run()
    chat = req("chat", [1], max_tokens=12, arrival=1.0)
    s.add(chat)
    run.step(s)
    rows = [bulk(f"b{i}", [2 + i], max_tokens=6, arrival=2.0 + i) for i in range(3)]
    for r in rows:
        s.add(r)
    for n in (1, 2, 3):
        run.step(s)
        assert s.num_running_bulk == n and len(waiting(s)) == 3 - n
    run.drain(s)
    assert_exact(run, [chat, *rows])


def test_within_the_hold_after_the_last_interactive_row_a_step_still_admits_one_bulk_request() -> None:
    # Bulk rows that end in the step the interactive ones end (equal lengths started together) are refilled a few
    # milliseconds before the clients' next interactive requests arrive: the refill must not be one long prefill.
    clock = Clock(10.0)
    s = scheduler(ToyBatch(), capacity=6, clock=clock, bulk_hold_s=1.0)
    run = Run()
    chat = req("chat", [1], max_tokens=2, arrival=1.0)
    s.add(chat)
    run.drain(s)  # the interactive row ran and ended
    rows = [bulk(f"b{i}", [2 + i], max_tokens=6, arrival=2.0 + i) for i in range(4)]
    for r in rows:
        s.add(r)
    clock.now += 0.5  # within the hold: one a step
    for n in (1, 2):
        run.step(s)
        assert s.num_running_bulk == n
    clock.now += 1.0  # past it: the rest as they come
    run.step(s)
    assert s.num_running_bulk == 4 and not waiting(s)
    run.drain(s)
    assert_exact(run, [chat, *rows])


def test_bulk_requests_alone_join_as_they_come() -> None:
    s = scheduler(ToyBatch(), capacity=4)
    run = Run()
    rows = [bulk(f"b{i}", [1 + i], max_tokens=5, arrival=1.0 + i) for i in range(4)]
    for r in rows:
        s.add(r)
    run.step(s)
    assert s.num_running_bulk == 4 and not waiting(s)  # no interactive row to keep steps short for
    run.drain(s)
    assert_exact(run, rows)


def test_a_step_that_admits_an_interactive_request_admits_no_bulk_one() -> None:
    # Nothing runs, so the interactive request joins the batch as usual: its prefill goes without a bulk prompt.
    s = scheduler(ToyBatch(), capacity=4)
    run = Run()
    rows = [bulk("b0", [1, 2], max_tokens=4, arrival=1.0), req("chat", [3], max_tokens=4, arrival=2.0)]
    for r in rows:
        s.add(r)
    run.step(s)
    assert run.started_order == ["chat"] and waiting(s) == ["b0"]
    run.step(s)
    assert run.started_order == ["chat", "b0"]
    run.drain(s)
    assert_exact(run, rows)


def test_requests_starting_at_once_in_one_step_are_prefilled_together() -> None:
    # Streams send their next jobs together: prefilled one by one, the last one's first token would wait for
    # every other one's prefill; in one batch, every first token goes out with the step.
    batch = ToyBatch()
    s = scheduler(batch, capacity=6, clock=Clock(10.0))
    run = Run()
    row = bulk("b0", [1, 2], max_tokens=10, arrival=1.0)
    s.add(row)
    run.step(s)
    chats = [req(f"c{i}", [3 + i, 1], max_tokens=3, arrival=5.0 + i) for i in range(3)]
    for c in chats:
        s.add(c)
    run.step(s)
    assert all(run.tokens(c.rid) == toy_generate(c.prompt_tokens, 1) for c in chats)
    assert batch.calls == ["start_many 3", "start", "start", "start"] and s.stats.started_at_once == 3
    assert batch.steps == 1  # no decode step in between: their first tokens came from the prefill
    late = req("late", [9, 1], max_tokens=3, arrival=9.0)  # alone in its step: prefilled alone
    s.add(late)
    run.step(s)
    assert batch.calls[-1] == "start" and run.tokens("late") == toy_generate([9, 1], 1)
    run.drain(s)
    assert_exact(run, [row, *chats, late])


def test_interactive_requests_arriving_together_at_an_engine_full_of_bulk_rows_all_start_in_one_step() -> None:
    # A batch fills every slot; streams' jobs come together: each takes a bulk row's place in the same step (one a
    # step, the last one's first token waited a step for each before it).
    batch = ToyBatch()
    s = scheduler(batch, capacity=4, clock=Clock(10.0))
    run = Run()
    rows = [bulk(f"b{i}", [1, 2 + i], max_tokens=12, arrival=1.0 + i) for i in range(4)]
    for r in rows:
        s.add(r)
    run.step(s, 2)
    chats = [req(f"c{i}", [5 + i, 1], max_tokens=3, arrival=9.0 + i) for i in range(3)]
    for c in chats:
        s.add(c)
    run.step(s)
    assert all(run.tokens(c.rid) == toy_generate(c.prompt_tokens, 1) for c in chats)  # every first token out
    assert s.stats.started_at_once == 3 and "start_many 3" in batch.calls
    run.step(s)  # (the last one's bulk row leaves at the start of the next step, as a lone request's does)
    assert s.stats.preemptions == 3 and sorted(waiting(s)) == ["b1", "b2", "b3"]  # the latest ones stepped aside
    run.drain(s)
    assert_exact(run, [*rows, *chats])
    assert (s.stats.resumes, s.stats.recomputes) == (3, 0)


def test_bulk_requests_waiting_to_join_leave_a_full_engine_outranked() -> None:
    # An interactive job may still be claimed for an engine full of bulk rows with more bulk requests waiting:
    # it goes before them, and takes a bulk row's place.
    s = scheduler(ToyBatch(), capacity=2)
    run = Run()
    for i in range(4):
        s.add(bulk(f"b{i}", [1 + i], max_tokens=6, arrival=1.0 + i))
    run.step(s)
    assert waiting(s) == ["b2", "b3"]
    assert (s.room.outranked, s.room.outranked_rows, s.room.admissible, s.room.paused) == (BULK, 2, 0, 0)
