"""``python3 -m tests.perf.scale``, the control plane's ceiling, at a tiny scale: a simulated worker process
(tests/perf/simworker.py), a gateway, a subscriber process, two streams (one through the gateway), one producer.

No wall-clock thresholds: only that every measurement is there and consistent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.perf import scale
from tests.perf.simworker import SimBatch
from tests.support import quick_run_fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a research run, however short

quick_run, results = quick_run_fixtures(
    lambda out: scale.main(["--out", str(out), "--quick", "--levels", "2", "--window", "1", "--enqueue-jobs", "50"]))


@pytest.fixture(scope="module")
def results_file(quick_run: tuple[Path, int, str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((quick_run[0] / "scale.json").read_text())
    return data


def test_a_tiny_run_writes_its_table_and_json(quick_run: tuple[Path, int, str]) -> None:
    out, code, stdout = quick_run
    assert code == 0
    assert (out / "scale.md").read_text().rstrip("\n") == stdout.rstrip("\n")
    assert "| 2 | 1 | 1 |" in stdout  # 2 streams, on 1 simulated engine, 1 of them through the gateway


def test_every_stream_was_delivered_and_timed_from_the_engines_output(results_file: dict[str, Any]) -> None:
    [level] = results_file["levels"]
    assert level["streams"] == 2 and level["via_gateway"] == 1
    assert level["completed"] == 2 and level["errors"] == []
    assert 0 < level["delivered"] <= 1.05  # tokens made in the window and delivered, against 2 streams' rate
    assert 0 < level["p50_ms"] <= level["p99_ms"] <= level["max_ms"]
    cpu = level["cpu"]
    assert len(cpu["workers"]) == 1 and len(cpu["subscribers"]) == 1 and cpu["gateway"] is not None
    assert min(cpu["redis"], *cpu["workers"], *cpu["subscribers"], cpu["gateway"]) >= 0
    assert level["redis_commands_s"] > 0 and level["bottleneck"]
    stats = level["commandstats"]  # calls and µs per command over the window: the token events' own among them
    assert all(stats[c][0] > 0 and stats[c][1] >= 0 for c in ("evalsha", "xadd", "publish"))


def test_one_producers_enqueue_rate_and_cpu_per_job_are_measured(results_file: dict[str, Any]) -> None:
    rounds = results_file["enqueue"]
    assert [r["concurrency"] for r in rounds] == [1, 16]
    assert all(r["jobs"] == 50 and r["jobs_s"] > 0 and r["producer_us"] > 0 for r in rounds)


def test_the_simulated_batch_steps_every_row_once_per_tick_and_ends_rows_at_their_length() -> None:
    batch = SimBatch(1000.0)  # a millisecond a tick: the test does not wait
    a, b = batch.insert([1], 2, None, []), batch.insert([1], 1, None, [])
    first = batch.step()
    assert [(t.uid, t.finish_reason) for t in first] == [(a, None), (b, "length")]
    assert [(t.uid, t.finish_reason) for t in batch.step()] == [(a, "length")]
    assert batch.step() == [] and batch.rows == {}
