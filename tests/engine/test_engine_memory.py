"""Admission by KV memory: the budget's arithmetic, the scheduler over the toy batch (tests/engine/fakes.py),
and the real tiny model, whose caches' measured bytes must stay under the headroom."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.engine.core.memory import DeviceMemory, KVBudget, KVLayout, default_headroom
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Room, Scheduler
from mlxq.engine.core.shares import GroupShare
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.memory import measure_layout, usable_memory_bytes
from tests.engine.fakes import Run, ToyBatch, req, scheduler, toy_generate, waiting

pytestmark = pytest.mark.unit

# --- arithmetic -----------------------------------------------------------------------------------------


def test_rows_are_charged_up_to_a_step_past_their_length_and_padded_to_the_longest() -> None:
    layout = KVLayout(bytes_per_token=10, step=4)
    assert [layout.row_bytes(n) for n in (0, 1, 4, 5, 8)] == [40, 40, 70, 80, 110]  # (n + 3) tokens
    budget = KVBudget(1000, layout)
    assert budget.batch_bytes(0, 99) == 0
    assert budget.batch_bytes(3, 5) == 3 * 80  # every row as long as the longest
    assert budget.rows_that_fit(longest=8, beside=200) == 7  # (1000 - 200) // 110


def test_default_headroom_rule_and_its_floor() -> None:
    layout = KVLayout(1000, 256)
    assert default_headroom(100_000_000, 10_000_000, 5_000_000, layout, 2048) == 75_000_000 - 15_000_000
    # A machine too small by the rule still admits one full-context sequence (and says so in the log).
    assert default_headroom(1_000_000, 900_000, 0, layout, 2048) == layout.row_bytes(2048)
    assert usable_memory_bytes() > 0


def test_the_usable_memory_is_the_devices_mlx_runs_on() -> None:
    import mlx.core as mx

    from mlxq.engine.mlx.memory import device_memory

    gpu, cpu = mx.Device(mx.gpu), mx.Device(mx.cpu)
    cuda = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 85_000_000_000,
            "free_memory": 84_000_000_000}
    assert device_memory(cuda, gpu) == DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 85_000_000_000)
    metal = {"device_name": "Apple M3 Max", "memory_size": 128 << 30, "max_recommended_working_set_size": 96 << 30}
    assert device_memory(metal, gpu) == DeviceMemory("metal", "Apple M3 Max", 96 << 30)
    here = device_memory(mx.device_info(), cpu)  # this machine's CPU: the smaller of RAM and MLX's limit
    assert here.backend == "cpu" and 0 < here.usable <= max(mx.get_memory_limit(), 1)
    assert "85,000" not in device_memory(cuda, gpu).describe() and "cuda" in device_memory(cuda, gpu).describe()
    # The defaults follow: a Linux GPU box's KV headroom is 75 % of its GPU's memory, less weights and prefix cache.
    usable = device_memory(cuda, gpu).usable
    assert default_headroom(usable, 16 << 30, 4 << 30, KVLayout(1000, 256), 8192) == int(usable * 0.75) - (20 << 30)


# --- the scheduler over the toy batch --------------------------------------------------------------------


def test_admission_never_exceeds_the_headroom_and_every_request_completes() -> None:
    rng = random.Random(7)
    batch = ToyBatch()
    headroom = 1200
    s = scheduler(batch, capacity=8, headroom=headroom)
    run = Run()
    shapes = {f"r{i}": (rng.randint(1, 12), rng.randint(1, 20)) for i in range(40)}
    for rid, (p, m) in shapes.items():
        s.add(req(rid, p, max_tokens=m))
    most = 0
    for _ in range(2000):
        if not s.has_work:
            break
        run.step(s)
        most = max(most, s.num_running)
        assert s.stats.kv_reserved_bytes <= headroom
    assert not s.has_work
    assert max(batch.kv_seen) <= headroom and s.stats.kv_bytes_peak == max(batch.kv_seen)
    assert 1 < most < 8  # memory, not slots, bounded the batch
    for rid, (p, m) in shapes.items():
        assert run.tokens(rid) == toy_generate(list(range(1, p + 1)), m)


@pytest.mark.parametrize(("prompt", "max_tokens", "message"), [
    (30, 20, "prompt (30 tokens) + max_tokens (20) exceeds the context (40) by 10 tokens"),
    (10, 25, "prompt (10 tokens) + max_tokens (25) needs 0.0 MiB of KV cache, 0.0 MiB more than this worker's "
             "KV headroom (0.0 MiB)"),
])
def test_a_request_that_can_never_fit_ends_at_once_saying_by_how_much(prompt: int, max_tokens: int,
                                                                        message: str) -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=2, headroom=300, context_length=40)  # 300 bytes: 28 tokens in 4-token steps
    s.add(req("big", prompt, max_tokens=max_tokens))
    s.add(req("ok", 2, max_tokens=3))
    assert len(waiting(s)) == 1 and s.stats.rejected_too_large == 1
    outs = {o.rid: o for o in s.step()}
    big = outs["big"]
    assert (big.finish, big.error_code, big.started) == (FinishReason.ERROR, "bad_request", False)
    assert big.error_message == message
    assert outs["ok"].started and [i["prompt"] for i in batch.inserted] == [[1, 2]]


def test_the_kv_message_gives_the_numbers() -> None:
    s = Scheduler(ToyBatch(), capacity=1, new_detokenizer=lambda: None,  # type: ignore[arg-type,return-value]
                  memory=KVBudget(64 << 20, KVLayout(1 << 20, 16)))
    s.add(req("big", 40, max_tokens=50))  # 90 tokens, up to 105 with its last 16-token step; 1 MiB a token
    (out,) = s.step()
    assert out.error_message == ("prompt (40 tokens) + max_tokens (50) needs 105.0 MiB of KV cache, 41.0 MiB more "
                                 "than this worker's KV headroom (64.0 MiB)")


def test_measured_bytes_beyond_the_estimate_hold_admission_back_and_a_fresh_reading_releases_it() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=4, headroom=400)
    run = Run()
    s.add(req("a", 2, max_tokens=6))  # 80 bytes by the estimate
    run.step(s)
    batch.kv_extra = 300  # the caches really hold 300 bytes more than estimated
    run.step(s)
    s.add(req("b", 2, max_tokens=6))
    run.step(s, 2)
    assert run.started_order == ["a"]  # 80 + 300 excess + 2 rows: no room
    batch.kv_extra = 0
    run.step(s)  # read after this step: right again
    assert run.started_order == ["a"]
    run.step(s)  # so the next admission takes "b"
    assert run.started_order == ["a", "b"]
    run.drain(s)


def test_a_stale_reading_never_rejects_everything() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=4, headroom=400)
    run = Run()
    for rid in ("a", "b", "c"):
        s.add(req(rid, 4, max_tokens=8))
    run.step(s, 3)
    assert s.stats.kv_bytes > 0
    for rid in ("a", "b", "c"):
        s.abort(rid)  # no step runs after this: the last reading is of a full batch
    assert s.stats.kv_bytes == 0
    s.add(req("d", 4, max_tokens=8))
    run.step(s)
    assert "d" in run.started_order


def test_room_is_free_slots_bounded_by_kv_minus_waiting() -> None:
    batch = ToyBatch()
    s = scheduler(batch, capacity=6, headroom=950)
    assert s.room.free_slots == s.room.admissible == 6
    run = Run()
    for i in range(3):
        s.add(req(f"r{i}", 4, max_tokens=12))  # 16 tokens: up to 190 bytes a row; 950 bytes: 5 such rows
    run.step(s)
    assert s.room == Room(free_slots=3, waiting=0, kv_rows=2, outranked=0, outranked_rows=3,
                          groups=(GroupShare("", 3, 1.0),)) and s.room.admissible == 2
    s.add(req("w0", 4, max_tokens=12))
    s.add(req("w1", 4, max_tokens=12))
    s.add(req("w2", 4, max_tokens=12))
    run.step(s)
    assert s.num_running == 5 and s.room.waiting == 1 and s.room.admissible == 0
    assert s.room.outranked is None  # a request that has not started waits: a newcomer would wait too
    run.drain(s)
    assert s.room == Room(6, 0, 5)
    assert Room(4, 1, 9).admissible == 3 and Room(4, 9, 9).admissible == 0


def test_before_its_first_request_an_engine_counts_on_requests_that_fill_the_context() -> None:
    # A cold worker claims only what it can surely start; what it admits then teaches it the typical size.
    s = scheduler(ToyBatch(), capacity=8, headroom=950, context_length=40)
    assert s.memory is not None and s.room.kv_rows == s.memory.rows_that_fit(40, 0) == 2
    run = Run()
    s.add(req("short", 4, max_tokens=4))
    run.drain(s)
    assert s.room.kv_rows == s.memory.rows_that_fit(8, 0) > 2


# --- the real tiny model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


def test_measured_layout_is_what_the_batch_allocates(lm: Any) -> None:
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = lm
    layout = measure_layout(model)
    assert layout.step == 256 and layout.bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K+V, kv heads, dim, fp32
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    gen.insert([[1] * 10, [2] * 300], max_tokens=[4, 4])
    for _ in range(3):
        gen.next()
    assert gen.prompt_cache_nbytes == 2 * 512 * layout.bytes_per_token  # both rows padded to 303, in 256-steps
    assert gen.prompt_cache_nbytes <= KVBudget(1 << 40, layout).batch_bytes(2, 303)
    gen.close()


def test_real_batch_stays_under_the_headroom_and_matches_mlx_lm(lm: Any) -> None:
    from tests.support import reference

    model, tokenizer = lm
    stream = mx.new_stream(mx.cpu)
    layout = measure_layout(model)
    headroom = 3 * layout.row_bytes(200)  # three rows of up to 256 tokens
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=8, prefill_batch_size=8, prefill_step_size=64,
                     stream=stream)
    s = Scheduler(batch, capacity=8, new_detokenizer=lambda: tokenizer.detokenizer,
                  memory=KVBudget(headroom, layout))
    rng = random.Random(3)
    prompts = {f"r{i}": tokenizer.encode(" ".join(rng.choice(["the", "queue", "model", "token"])
                                                  for _ in range(rng.randint(3, 60)))) for i in range(8)}
    for rid, p in prompts.items():
        s.add(EngineRequest(rid, p, SamplingParams(max_tokens=40)))
    run = Run()
    with mx.stream(stream):
        for _ in range(1000):
            if not s.has_work:
                break
            run.step(s)
            assert batch.kv_bytes() <= headroom and s.num_running <= 3
    assert not s.has_work and 0 < s.stats.kv_bytes_peak <= headroom
    for rid, p in prompts.items():
        assert run.tokens(rid) == reference(lm, p, 40), rid
    batch.close()
