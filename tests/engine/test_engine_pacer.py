"""The Pacer: step outputs deferred up to an interval and merged per request; first tokens and ends never
deferred, starts stamped when their step handed them over."""

from __future__ import annotations

import pytest

from mlxq.engine.core.pacer import Pacer
from mlxq.engine.core.request import FinishReason, RequestOutput

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def token(rid: str, token_id: int, generated: int, text: str | None = None) -> RequestOutput:
    """One step's output carrying one token, the request's ``generated``-th."""
    return RequestOutput(rid, [token_id], text if text is not None else str(token_id), completion_tokens=generated)


def test_zero_interval_passes_every_step_through() -> None:
    pacer = Pacer(0.0, Clock())
    assert [o.token_ids for o in pacer.push([token("a", 1, 1)])] == [[1]]
    assert [o.token_ids for o in pacer.push([token("a", 2, 2)])] == [[2]]
    assert not pacer.deferring


def test_start_waits_for_the_first_token_stamped_when_its_step_ended_later_tokens_wait_for_the_interval() -> None:
    clock, wall = Clock(), Clock()
    wall.now = 1_700_000_000.0
    pacer = Pacer(0.010, clock, wall=wall)
    pacer.push([token("b", 1, 1)])  # another request's send: the interval starts again
    started = RequestOutput("a", started=True, prompt_tokens=5)  # admission: no token yet
    assert pacer.push([started]) == []  # deferred: it goes out with the first token, in one send
    assert started.started_at == 1_700_000_000.0  # ... but its time queued ended here
    wall.now += 0.002  # two steps later
    (first,) = pacer.push([token("a", 7, 1)])
    assert (first.started, first.prompt_tokens, first.token_ids) == (True, 5, [7])
    assert first.started_at == 1_700_000_000.0
    clock.now += 0.003
    assert pacer.push([token("a", 8, 2)]) == []
    clock.now += 0.003
    assert pacer.push([token("a", 9, 3)]) == []
    clock.now += 0.005  # 11 ms after the last send
    (merged,) = pacer.push([token("a", 10, 4)])
    assert (merged.token_ids, merged.text, merged.completion_tokens) == ([8, 9, 10], "8910", 4)
    assert not pacer.deferring


def test_finish_flushes_what_the_request_deferred_merged_in_order() -> None:
    clock = Clock()
    pacer = Pacer(1.0, clock)
    pacer.push([token("a", 1, 1), token("b", 1, 1)])  # both first tokens: out at once
    assert pacer.push([token("a", 2, 2), token("b", 2, 2)]) == []
    end = RequestOutput("a", [3], "3", completion_tokens=3, finish=FinishReason.LENGTH)
    (done,) = pacer.push([end])
    assert (done.rid, done.token_ids, done.text, done.finish) == ("a", [2, 3], "23", FinishReason.LENGTH)
    assert pacer.deferring  # b's second token still waits
    (b,) = pacer.push([], flush=True)
    assert (b.rid, b.token_ids) == ("b", [2])


def test_an_error_end_without_tokens_is_not_deferred() -> None:
    pacer = Pacer(1.0, Clock())
    pacer.push([token("a", 1, 1)])
    pacer.push([token("a", 2, 2)])
    err = RequestOutput("a", finish=FinishReason.ERROR, error_code="timeout", error_message="late",
                        completion_tokens=2)
    (out,) = pacer.push([err])
    assert (out.token_ids, out.finish, out.error_code) == ([2], FinishReason.ERROR, "timeout")


def test_interval_is_shared_so_all_requests_go_out_together() -> None:
    clock = Clock()
    pacer = Pacer(0.010, clock)
    pacer.push([token(r, 0, 1) for r in "abc"])
    for n in range(2, 6):
        clock.now += 0.004
        due = pacer.push([token(r, n, n) for r in "abc"])
        assert due == [] or sorted(o.rid for o in due) == ["a", "b", "c"]
    # 16 ms in: one send of all three has happened, deferring only what came since
    assert pacer.deferring


def test_nothing_after_a_requests_end_is_sent() -> None:
    pacer = Pacer(1.0, Clock())
    pacer.push([token("a", 1, 1)])
    pacer.push([token("a", 2, 2)])
    late = [RequestOutput("a", finish=FinishReason.CANCELLED, completion_tokens=2), token("a", 3, 3)]
    (out,) = pacer.push(late)
    assert (out.token_ids, out.finish) == ([2], FinishReason.CANCELLED)


def test_a_step_writing_into_the_deferred_outputs_sends_what_merging_its_own_sends() -> None:
    """The engine's way (engine.py): a scheduler step adds its tokens to the outputs the pacer defers, in place,
    instead of a record per request to merge; what goes out, and when, is the same (stops, a length end, an
    abort between steps and a request joining late included)."""
    from dataclasses import astuple

    from tests.engine.fakes import ToyBatch, req, scheduler

    def sent(in_place: bool) -> list[list[tuple[object, ...]]]:
        clock = Clock()
        sched = scheduler(ToyBatch(), capacity=4)
        pacer = Pacer(0.010, clock, wall=clock)
        for rid, n in (("a", 9), ("b", 3), ("c", 12)):
            sched.add(req(rid, 3, max_tokens=n))
        batches = []
        for i in range(16):
            if i == 4:
                sched.add(req("d", 2, max_tokens=5))
            outs = sched.step(pacer.deferred) if in_place else sched.step()
            if i == 6:
                aborted = sched.abort("c")
                assert aborted is not None
                outs.append(aborted)
            clock.now += 0.004
            batches.append([astuple(o) for o in pacer.push(outs, flush=not sched.has_work)])
        return batches

    assert sent(True) == sent(False)
    assert sum(len(b) for b in sent(True)) > 4  # several sends, some merged over steps


def test_a_rate_lengthens_the_interval_in_proportion_to_the_requests_deferred() -> None:
    """At 1,000 outputs a second, 40 requests go out every 40 ms (not every 10), 5 every 10 ms: what streaming
    sends a second stays bounded as the batch grows; first tokens still go out at once."""
    for rows, every_ms in ((40, 40), (5, 10)):
        clock = Clock()
        pacer = Pacer(0.010, clock, rate=1000.0)
        rids = [f"r{i}" for i in range(rows)]
        assert len(pacer.push([token(r, 0, 1) for r in rids])) == rows  # first tokens: out at once
        sends, sent = [], 0
        for n in range(2, 82):  # 80 steps of 1 ms
            clock.now += 0.001
            due = pacer.push([token(r, n, n) for r in rids])
            if due:
                assert len(due) == rows
                sends.append(n - 1)  # ms since the first tokens
                sent += len(due)
        assert sends == list(range(every_ms, 81, every_ms))
        assert sent / 0.080 <= 1000.0


def test_no_rate_keeps_the_interval() -> None:
    clock = Clock()
    pacer = Pacer(0.010, clock)
    rids = [f"r{i}" for i in range(200)]
    pacer.push([token(r, 0, 1) for r in rids])
    clock.now += 0.011
    assert len(pacer.push([token(r, 1, 2) for r in rids])) == 200
    assert pacer.interval() == 0.010


def test_a_bulk_requests_outputs_wait_for_its_end_or_the_bulk_interval_first_token_included() -> None:
    clock = Clock()
    pacer = Pacer(0.010, clock, bulk_interval_s=1.0)
    pacer.hold("bulk")
    assert pacer.push([RequestOutput("bulk", started=True, prompt_tokens=4), token("bulk", 1, 1)]) == []
    (chat,) = pacer.push([token("chat", 5, 1)])  # an interactive request's first token: out at once
    assert chat.rid == "chat"
    clock.now += 0.020  # the interval's send: the interactive request's tokens, not the bulk one's
    assert [o.rid for o in pacer.push([token("bulk", 2, 2), token("chat", 6, 2)])] == ["chat"]
    clock.now += 1.0  # the bulk interval's send: everything
    due = pacer.push([token("bulk", 3, 3)])
    assert [(o.rid, o.token_ids, o.started) for o in due] == [("bulk", [1, 2, 3], True)]
    end = RequestOutput("bulk", [4], "4", completion_tokens=4, finish=FinishReason.LENGTH)
    (done,) = pacer.push([end])  # its end: at once
    assert (done.token_ids, done.finish) == ([4], FinishReason.LENGTH)
    assert pacer.push([token("bulk", 9, 1)]) != []  # its id is forgotten with its end: a new request's streams
