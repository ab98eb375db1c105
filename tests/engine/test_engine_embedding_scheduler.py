"""The embedding scheduler (engine/core/embedding.py) with a fake forward pass: rows of many requests in one pass,
oldest first, within the pass's bounds; a request ends once its last row is through, its vectors in its inputs'
order; aborts, deadlines, failures and the room it reports. Then the same scheduler under the real Engine: a
burst of requests announced together goes through in one pass."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Sequence

import pytest

from mlxq.engine.core.embedding import EmbeddingRequest, EmbeddingScheduler, Row
from mlxq.engine.core.engine import Engine
from mlxq.engine.core.request import EngineRequest, ErrorCode, FinishReason, RequestOutput
from mlxq.engine.mlx.thread import MLXThread

pytestmark = pytest.mark.unit


class FakePass:
    """A forward pass whose vector of a row is (its first token, its length, its dimensions or 0): each vector
    says which input it is of. Records every pass's rows."""

    def __init__(self) -> None:
        self.passes: list[list[Row]] = []
        self.fail = False

    def embed(self, rows: Sequence[Row]) -> list[bytes]:
        if self.fail:
            raise RuntimeError("the forward pass failed")
        self.passes.append(list(rows))
        return [struct.pack("<3f", r.tokens[0], len(r.tokens), r.dimensions or 0) for r in rows]

    def close(self) -> None:
        pass


def vector(out: bytes) -> tuple[float, ...]:
    return struct.unpack("<3f", out)


def request(rid: str, *inputs: list[int], dimensions: int | None = None, priority: int = 0,
            deadline: float | None = None) -> EmbeddingRequest:
    return EmbeddingRequest(rid, [], inputs=list(inputs), dimensions=dimensions, priority=priority,
                            deadline=deadline)


def test_rows_of_several_requests_go_through_in_one_pass_each_ending_with_its_vectors_in_order() -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8, max_rows=8)
    sched.add(request("a", [1, 2, 3], [4]))
    sched.add(request("b", [5, 6], dimensions=2))
    sched.add(request("c", [7], [8, 8], [9, 9, 9]))
    outs = sched.step()
    assert len(fake.passes) == 1 and [(r.rid, r.index) for r in fake.passes[0]] == [
        ("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2)]
    assert sched.counts.passes == 1 and sched.counts.largest == 6 and sched.counts.mixed == 1
    by = {o.rid: o for o in outs}
    assert set(by) == {"a", "b", "c"} and not sched.has_work and sched.num_running == 0
    assert all(o.finish is FinishReason.STOP and o.started for o in outs)
    assert [vector(v) for v in by["a"].embeddings or []] == [(1, 3, 0), (4, 1, 0)]
    assert [vector(v) for v in by["b"].embeddings or []] == [(5, 2, 2)]
    assert [vector(v) for v in by["c"].embeddings or []] == [(7, 1, 0), (8, 2, 0), (9, 3, 0)]
    assert (by["a"].prompt_tokens, by["b"].prompt_tokens, by["c"].prompt_tokens) == (4, 2, 6)


def test_a_pass_takes_at_most_max_rows_and_max_tokens_and_a_request_ends_with_its_last_row() -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8, max_rows=3, max_tokens=8)
    sched.add(request("a", [1], [2], [3], [4]))  # four rows: more than a pass takes
    sched.add(request("b", [5, 5, 5, 5]))
    assert sched.step() == []  # a's first three rows
    assert [r.index for r in fake.passes[0]] == [0, 1, 2]
    outs = sched.step()  # a's last row, and b's: 2 rows x 4 tokens fit 8
    assert [o.rid for o in outs] == ["a", "b"] and [(r.rid, r.index) for r in fake.passes[1]] == [("a", 3), ("b", 0)]
    assert [vector(v)[0] for v in outs[0].embeddings or []] == [1, 2, 3, 4]


def test_the_padded_token_budget_splits_passes_but_a_long_row_still_goes_alone() -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8, max_rows=8, max_tokens=10)
    sched.add(request("long", [1] * 20))
    sched.add(request("short", [2], [3]))
    sched.step()
    sched.step()
    assert [[r.rid for r in p] for p in fake.passes] == [["long"], ["short", "short"]]


def test_higher_priority_rows_run_first_and_arrival_order_holds_within_a_priority() -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8, max_rows=2)
    sched.add(request("low1", [1]))
    sched.add(request("lowest", [0], priority=-3))
    sched.add(request("low2", [2]))
    sched.add(request("high", [3], priority=5))
    for _ in range(3):
        sched.step()
    assert [[r.rid for r in p] for p in fake.passes] == [["high", "low1"], ["low2", "lowest"]]


def test_an_abort_drops_the_requests_rows_and_an_unknown_id_is_ignored() -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8)
    sched.add(request("a", [1], [2]))
    sched.add(request("b", [3]))
    out = sched.abort("a")
    assert out is not None and out.finish is FinishReason.CANCELLED and out.embeddings is None
    assert sched.abort("a") is None and sched.abort("nobody") is None
    assert [o.rid for o in sched.step()] == ["b"] and [r.rid for r in fake.passes[0]] == ["b"]


def test_a_request_past_its_deadline_ends_with_timeout_before_its_rows_run() -> None:
    now = [100.0]
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=8, clock=lambda: now[0])
    sched.add(request("late", [1], deadline=99.0))
    sched.add(request("fine", [2], deadline=200.0))
    outs = sched.step()
    late = next(o for o in outs if o.rid == "late")
    assert late.finish is FinishReason.ERROR and late.error_code is ErrorCode.TIMEOUT
    assert [r.rid for r in fake.passes[0]] == ["fine"]


def test_a_generation_request_is_refused_with_bad_request_at_the_next_step() -> None:
    sched = EmbeddingScheduler(FakePass(), capacity=8)
    sched.add(EngineRequest("gen", [1, 2, 3]))
    assert sched.has_work
    (out,) = sched.step()
    assert out.rid == "gen" and out.finish is FinishReason.ERROR and out.error_code is ErrorCode.BAD_REQUEST
    assert not sched.has_work


def test_fail_all_ends_every_request_and_the_room_counts_requests() -> None:
    sched = EmbeddingScheduler(FakePass(), capacity=3)
    assert sched.room.admissible == 3
    sched.add(request("a", [1], [2], [3]))
    sched.add(request("b", [4]))
    assert sched.room.admissible == 1 and sched.num_running == 2 and sorted(sched.request_ids()) == ["a", "b"]
    outs = sched.fail_all(ErrorCode.ENGINE_ERROR, "boom")
    assert sorted(o.rid for o in outs) == ["a", "b"]
    assert all(o.error_code is ErrorCode.ENGINE_ERROR for o in outs)
    assert sched.room.admissible == 3 and not sched.has_work


async def test_under_the_engine_a_burst_announced_together_runs_in_one_pass_and_a_failure_fails_its_requests(
        ) -> None:
    fake = FakePass()
    sched = EmbeddingScheduler(fake, capacity=16, max_rows=16)
    got: list[RequestOutput] = []
    ended = threading.Event()
    want = 6

    def sink(outs: list[RequestOutput]) -> None:
        got.extend(outs)
        if len(got) >= want:
            ended.set()

    engine = Engine(MLXThread("embed-burst"), sched, sink, make_backend=FakePass, prefill_batch=16)
    try:
        engine.expect(want, 5.0)  # an idle engine waits for all six before its first pass
        for i in range(want):
            engine.add(request(f"r{i}", [i + 1], [i + 1, 0]))
            await asyncio.sleep(0.001)
        assert await asyncio.to_thread(ended.wait, 10)
        assert len(fake.passes) == 1 and len(fake.passes[0]) == 2 * want
        assert sorted(o.rid for o in got) == [f"r{i}" for i in range(want)]
        assert all(len(o.embeddings or []) == 2 for o in got)
        # A failing pass fails its requests; the engine makes a fresh backend and keeps serving.
        fake.fail = True
        got.clear()
        ended.clear()
        want = 1
        engine.add(request("doomed", [1]))
        assert await asyncio.to_thread(ended.wait, 10)
        (failed,) = got
        assert failed.rid == "doomed" and failed.error_code is ErrorCode.ENGINE_ERROR and not engine.dead
        assert isinstance(sched.backend, FakePass) and sched.backend is not fake
    finally:
        await engine.aclose()
