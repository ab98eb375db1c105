"""Priority with aging, and preemption, driven step by step over the toy batch (tests/engine/fakes.py)."""

from __future__ import annotations

import pytest

from mlxq.engine.core.request import FinishReason
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.core.waiting import WaitingQueue, priority_key
from tests.engine.fakes import Clock, Run, ToyBatch, req, scheduler, toy_generate, waiting

pytestmark = pytest.mark.unit

# --- the waiting queue ----------------------------------------------------------------------------------


def test_waiting_queue_orders_by_key_then_order_and_removes_by_id() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    q.push("late", 5.0, 0, "late")
    q.push("b", 1.0, 2, "b")
    q.push("a", 1.0, 1, "a")
    q.push("gone", 0.5, 3, "gone")
    assert q.remove("gone") == "gone" and q.remove("gone") is None
    assert len(q) == 3 and list(q) == ["late", "b", "a"]  # iteration: the order they came in
    assert [q.pop(), q.pop(), q.pop()] == ["a", "b", "late"]
    assert not q and q.peek() is None
    with pytest.raises(IndexError):
        q.pop()


def test_priority_key_moves_a_request_earlier_by_aging_per_level() -> None:
    assert priority_key(100.0, 0, 1.0) == 100.0
    assert priority_key(100.0, 3, 1.0) == 97.0
    assert priority_key(100.0, 3, 0.5) == 98.5
    assert priority_key(100.0, -2, 1.0) == 102.0  # below normal


# --- order of admission ---------------------------------------------------------------------------------


def admitted_order(rids_and_reqs: list, capacity: int = 1, aging_s: float = 1.0) -> list[str]:
    """Admit one at a time (each runs 1 token) and return the order they started in."""
    batch = ToyBatch()
    s = scheduler(batch, capacity=capacity, aging_s=aging_s)
    for r in rids_and_reqs:
        s.add(r)
    run = Run()
    run.drain(s)
    return run.started_order


def test_higher_priority_first_and_fcfs_within_a_level() -> None:
    reqs = [req("x0", max_tokens=1, arrival=10.0), req("y5", max_tokens=1, priority=5, arrival=10.1),
            req("x1", max_tokens=1, arrival=10.2), req("w5", max_tokens=1, priority=5, arrival=10.3),
            req("low", max_tokens=1, priority=-1, arrival=9.3)]
    assert admitted_order(reqs) == ["y5", "w5", "x0", "x1", "low"]  # low: key 10.3, after x1 (10.2)


def test_equal_keys_keep_the_order_they_came_in() -> None:
    reqs = [req(f"r{i}", max_tokens=1) for i in range(6)]  # no arrival: the scheduler's clock, all equal
    assert admitted_order(reqs) == [f"r{i}" for i in range(6)]


def test_aging_bounds_the_wait_behind_a_stream_of_higher_priority_requests() -> None:
    # With aging 1 s per level, a priority-1 request goes ahead of a priority-0 one only if it arrived less
    # than 1 s after it: the old one is not starved by a stream of them.
    stream = [req(f"hi{i}", max_tokens=1, priority=1, arrival=100.0 + 0.4 * i) for i in range(6)]
    old = req("old", max_tokens=1, priority=0, arrival=100.5)
    order = admitted_order([*stream, old])
    assert order.index("old") == 4  # after hi0..hi3 (arrived before 101.5), before hi4 (101.6) and hi5
    assert order[:4] == ["hi0", "hi1", "hi2", "hi3"]


def test_first_waiting_request_that_cannot_join_holds_back_the_rest() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=2, headroom=240)  # rows of n tokens are charged (n + 3) x 10 bytes
    run = Run()
    s.add(req("a", 2, max_tokens=6, arrival=1.0))  # 8 tokens: 110 bytes
    s.add(req("big", 6, max_tokens=14, arrival=2.0))  # 20 tokens: 230 bytes alone; with "a": 2 x 230
    s.add(req("small", 1, max_tokens=1, arrival=3.0))  # 2 x 110 beside "a", but it must not overtake "big"
    run.step(s)
    assert run.started_order == ["a"]
    run.drain(s)
    assert run.started_order == ["a", "big", "small"]


# --- preemption -------------------------------------------------------------------------------------------


def test_a_higher_priority_request_preempts_the_latest_lowest_and_everyone_continues_seamlessly() -> None:
    clock = Clock(50.0)
    batch = ToyBatch()
    s = scheduler(batch, capacity=2, clock=clock)
    run = Run()
    s.add(req("old", [1, 2, 3], max_tokens=12, arrival=50.0))
    s.add(req("new", [4, 5], max_tokens=12, arrival=50.2))
    run.step(s, 4)
    s.add(req("vip", [6], max_tokens=5, priority=3, arrival=50.5))
    run.step(s)  # vip starts at once; "new" leaves at the start of the next step
    assert run.tokens("vip") == toy_generate([6], 1) and s.stats.preemptions == 0
    run.step(s)
    assert run.started_order == ["old", "new", "vip"]
    assert s.stats.preemptions == 1 and len(waiting(s)) == 1 and s.request_ids()[0] == "new"
    run.drain(s)
    for rid, prompt, n in (("old", [1, 2, 3], 12), ("new", [4, 5], 12), ("vip", [6], 5)):
        assert run.tokens(rid) == toy_generate(prompt, n), rid  # no gap, no repeat, no restart
        assert run.final(rid).finish is FinishReason.LENGTH and run.final(rid).completion_tokens == n
        assert run.text(rid) == "".join(f"<{t}>" for t in toy_generate(prompt, n))
    assert run.started_order.count("new") == 1  # resumed, not started again
    assert (s.stats.resumes, s.stats.recomputes) == (1, 0)
    resume = batch.inserted[-1]
    assert resume["prompt"] == toy_generate([4, 5], 4)[-1:] and resume["cached"] == 2 + 3  # fed the last token
    assert resume["max_tokens"] == 12 - 4


def test_equal_priority_never_preempts_and_aging_protects_older_sequences() -> None:
    clock = Clock(100.0)
    batch = ToyBatch()
    s = scheduler(batch, capacity=1, clock=clock, aging_s=1.0)
    run = Run()
    s.add(req("running", max_tokens=6, arrival=100.0))
    run.step(s)
    s.add(req("same", max_tokens=2, arrival=100.1))  # same priority: waits
    s.add(req("later", max_tokens=2, priority=2, arrival=102.5))  # key 100.5 > 100.0: the running one is protected
    run.step(s, 3)
    assert s.stats.preemptions == 0 and run.started_order == ["running"]
    run.drain(s)
    assert run.started_order == ["running", "same", "later"]


def test_preemption_recomputes_on_a_backend_without_caches() -> None:
    batch = ToyBatch(caches=False)
    s = scheduler(batch, capacity=1)
    run = Run()
    s.add(req("low", [3, 1], max_tokens=10))
    run.step(s, 4)
    s.add(req("high", [2], max_tokens=3, priority=1))
    run.drain(s)
    assert run.tokens("low") == toy_generate([3, 1], 10)
    assert run.tokens("high") == toy_generate([2], 3)
    assert (s.stats.preemptions, s.stats.resumes, s.stats.recomputes) == (1, 0, 1)
    again = batch.inserted[-1]  # prompt + what it had generated, for what is left
    assert again["prompt"] == [3, 1, *toy_generate([3, 1], 4)] and again["max_tokens"] == 6


def test_a_cache_that_cannot_be_trimmed_is_recomputed() -> None:
    batch = ToyBatch(trimmable=False)
    s = scheduler(batch, capacity=1)
    run = Run()
    s.add(req("low", [5], max_tokens=9))
    run.step(s, 3)
    s.add(req("high", [7], max_tokens=2, priority=1))
    run.drain(s)
    assert run.tokens("low") == toy_generate([5], 9)
    assert (s.stats.resumes, s.stats.recomputes) == (0, 1)


def test_preempted_twice_still_continues_exactly() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=1)
    run = Run()
    s.add(req("low", [9, 9], max_tokens=15))
    run.step(s, 3)
    s.add(req("h1", [1], max_tokens=2, priority=1))
    run.step(s, 4)
    s.add(req("h2", [2], max_tokens=2, priority=1))
    run.drain(s)
    assert run.tokens("low") == toy_generate([9, 9], 15)
    assert s.stats.preemptions == 2 and s.stats.resumes == 2


def test_preemption_frees_kv_when_only_dropping_caches_makes_room() -> None:
    # Memory, not slots, is the bottleneck: parking the victim's cache would leave no room for the urgent
    # request, so the victim's cache is dropped and it recomputes.
    batch = ToyBatch()
    s = scheduler(batch, capacity=4, headroom=450)
    run = Run()
    s.add(req("low", 8, max_tokens=8))  # 16 tokens: 190 bytes
    run.step(s, 5)
    s.add(req("urgent", 4, max_tokens=32, priority=1))  # 36 tokens: 390 bytes; beside "low": 2 x 390
    run.step(s)
    assert s.stats.preemptions == 1 and s.stats.recomputes == 0
    assert s.stats.kv_bytes <= 450
    run.drain(s)
    assert run.tokens("low") == toy_generate(list(range(1, 9)), 8)
    assert s.stats.recomputes == 1
    assert max(batch.kv_seen) <= 450 and s.stats.kv_bytes_peak <= 450


def low_preempted_parking_its_cache(headroom: int, high_tokens: int) -> tuple[ToyBatch, Scheduler, Run]:
    """One slot: "low" runs 4 steps, then "high" starts at once and "low" leaves, keeping its cache."""
    batch = ToyBatch()
    s = scheduler(batch, capacity=1, headroom=headroom)
    run = Run()
    s.add(req("low", 10, max_tokens=10))
    run.step(s, 4)
    s.add(req("high", 2, max_tokens=high_tokens, priority=1))
    run.step(s, 2)  # "high" starts at once, "low" leaves at the start of the next step
    return batch, s, run


def test_a_parked_cache_counts_against_the_headroom() -> None:
    batch, s, run = low_preempted_parking_its_cache(1000, 4)
    parked = (10 + 4) * 10  # its prompt and 4 tokens, 10 bytes each
    assert s.stats.kv_bytes == batch.kv_bytes() + parked
    assert s.stats.kv_reserved_bytes == s.memory.batch_bytes(1, 6) + parked  # type: ignore[union-attr]
    out = s.abort("low")  # a cancelled preempted request frees its cache
    assert out is not None and out.finish is FinishReason.CANCELLED and out.completion_tokens == 4
    assert s.stats.kv_bytes == batch.kv_bytes()
    assert s.stats.kv_reserved_bytes == s.memory.batch_bytes(1, 6)  # type: ignore[union-attr]


def test_a_preempted_request_past_its_deadline_times_out() -> None:
    clock = Clock()
    batch = ToyBatch()
    s = scheduler(batch, capacity=1, clock=clock)
    run = Run()
    s.add(req("low", max_tokens=50, deadline=clock.now + 5))
    run.step(s, 2)
    s.add(req("high", max_tokens=40, priority=1))
    run.step(s, 2)
    clock.now += 10
    run.step(s)
    assert run.final("low").error_code == "timeout" and run.final("low").completion_tokens == 2
    assert s.request_ids() == ["high"] and s.stats.kv_bytes == batch.kv_bytes()


def test_fail_all_drops_preempted_requests_and_their_caches() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=1, headroom=10_000)
    run = Run()
    s.add(req("low", max_tokens=50))
    run.step(s, 2)
    s.add(req("high", max_tokens=40, priority=1))
    run.step(s)
    outs = {o.rid: o for o in s.fail_all("engine_error", "boom")}
    assert set(outs) == {"low", "high"} and outs["low"].completion_tokens == 2
    assert not s.has_work and s.stats.kv_bytes == 0 and s.stats.kv_reserved_bytes == 0


def test_a_request_that_outranks_a_running_one_starts_at_once() -> None:
    # A free slot, so no preemption: the urgent request is prefilled alone and its first token goes out in the
    # step that admitted it, with no decode step of the batch before it; then it joins the batch and goes on.
    batch = ToyBatch()
    s = scheduler(batch, capacity=4)
    run = Run()
    s.add(req("low", [5, 6], max_tokens=12))
    run.step(s, 3)
    s.add(req("urgent", [7, 8, 9], max_tokens=6, priority=2))
    steps = batch.steps
    run.step(s)
    assert batch.steps == steps  # no decode ran in that step
    assert run.tokens("urgent") == toy_generate([7, 8, 9], 1)
    assert batch.started == [{"prompt": [7, 8, 9], "cached": 0, "at_step": steps}]
    assert s.stats.started_at_once == 1 and s.stats.preemptions == 0
    run.drain(s)
    assert run.tokens("urgent") == toy_generate([7, 8, 9], 6)
    assert run.tokens("low") == toy_generate([5, 6], 12)
    assert run.final("urgent").completion_tokens == 6


def test_requests_of_equal_or_lower_priority_join_the_batch_the_usual_way() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=4)
    run = Run()
    s.add(req("a", max_tokens=8, priority=1))
    run.step(s, 2)
    s.add(req("same", max_tokens=8, priority=1))
    s.add(req("lower", max_tokens=8, priority=0))
    run.drain(s)
    assert batch.started == [] and s.stats.started_at_once == 0
    assert run.tokens("same") == run.tokens("lower") == toy_generate([1, 2, 3], 8)


def test_an_urgent_request_of_one_token_ends_with_it_and_leaves_nothing_in_the_batch() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=4)
    run = Run()
    s.add(req("low", max_tokens=20))
    run.step(s, 2)
    s.add(req("one", [4, 4], max_tokens=1, priority=1))
    run.step(s)
    final = run.final("one")
    assert final.finish is FinishReason.LENGTH and final.completion_tokens == 1
    assert run.tokens("one") == toy_generate([4, 4], 1)
    assert len(batch.rows) == 1 and s.request_ids() == ["low"]
    run.drain(s)
    assert run.tokens("low") == toy_generate([1, 2, 3], 20)


def two_busy_slots_and_an_urgent_request() -> tuple[ToyBatch, Scheduler, Run]:
    """Both slots decoding ("a", "b"), then "urgent" (priority 1) added: only a slot is short."""
    batch = ToyBatch()
    s = scheduler(batch, capacity=2, headroom=10_000)
    run = Run()
    s.add(req("a", [1, 1], max_tokens=30))
    s.add(req("b", [2, 2], max_tokens=30))
    run.step(s, 3)
    s.add(req("urgent", [3, 3, 3], max_tokens=5, priority=1))
    return batch, s, run


def test_when_only_a_slot_is_short_the_urgent_request_starts_before_its_victim_leaves() -> None:
    # Taking a cache out copies the batch's caches: the urgent request's first token does not wait for that.
    batch, s, run = two_busy_slots_and_an_urgent_request()
    steps = batch.steps
    run.step(s)  # its first token goes out with this step's outputs, before any cache is taken out
    assert batch.calls == ["start"] and run.tokens("urgent") == toy_generate([3, 3, 3], 1)
    run.step(s)  # the victim leaves before the batch's next decode step
    assert batch.calls == ["start", "take"] and s.stats.preemptions == 1 and s.num_running == 2
    assert batch.steps == steps + 1
    assert s.stats.kv_bytes <= 10_000
    run.drain(s)
    for rid, prompt in (("a", [1, 1]), ("b", [2, 2])):
        assert run.tokens(rid) == toy_generate(prompt, 30)
    assert run.tokens("urgent") == toy_generate([3, 3, 3], 5)


def test_when_memory_is_short_the_victims_leave_before_the_urgent_request_starts() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=4, headroom=450)
    run = Run()
    s.add(req("low", 8, max_tokens=8))
    run.step(s, 5)
    s.add(req("urgent", 4, max_tokens=32, priority=1))  # does not fit beside "low"
    run.step(s)
    assert batch.calls == ["take", "start"]
    assert max(batch.kv_seen) <= 450 and s.stats.kv_bytes <= 450


def test_caches_parked_behind_the_first_waiting_request_never_keep_it_out_of_an_idle_batch() -> None:
    # "low" is preempted parking its cache; "top" then waits first and fits the headroom alone but not beside
    # that parked cache, with nothing running to preempt: the parked cache goes (low recomputes), top runs.
    batch, s, run = low_preempted_parking_its_cache(400, 2)
    assert s.stats.preemptions == 1 and s.stats.kv_reserved_bytes > s.memory.batch_bytes(1, 4)  # type: ignore[union-attr]
    s.add(req("top", 20, max_tokens=15, priority=5))
    run.drain(s)
    assert run.final("top").finish is FinishReason.LENGTH and run.tokens("top") == toy_generate(list(range(1, 21)), 15)
    assert run.tokens("low") == toy_generate(list(range(1, 11)), 10) and s.stats.recomputes == 1
    assert max(batch.kv_seen) <= 400 and not s.has_work


def test_an_urgent_request_aborted_before_its_victim_leaves_preempts_nobody() -> None:
    batch, s, run = two_busy_slots_and_an_urgent_request()
    run.step(s)  # it starts at once; its victim would leave at the start of the next step
    assert s.abort("urgent") is not None
    run.step(s)
    assert s.stats.preemptions == 0 and s.num_running == 2 and "take" not in batch.calls
    run.drain(s)
    for rid, prompt in (("a", [1, 1]), ("b", [2, 2])):
        assert run.tokens(rid) == toy_generate(prompt, 30)
