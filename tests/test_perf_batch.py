"""``python3 -m tests.perf.batch``, the Batch API's benchmark: how it judges its pairs, and (slow) its quick run end
to end (an embedded Redis, a worker process on the tiny model, raw mlx-lm in this process, a feeder here).

No wall-clock thresholds: only that every result is there and consistent.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.perf import batch
from tests.perf.batch import Pair


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"lines": 1000, "max_tokens": 32, "capacity": 32, "window": 256, **kw})


@pytest.mark.unit
def test_the_verdict_is_the_best_batch_over_the_best_raw() -> None:
    pairs = [Pair(100.0, 96.0, 3200, 3200, 33.3), Pair(90.0, 80.0, 3200, 3200, 40.0)]
    md = batch.markdown(args(), "m", pairs, [])
    assert "**0.960**" in md and "PASS" in md and "| 2 | 90.0 | 80.0 | 0.889 |" in md
    slow = [Pair(100.0, 90.0, 3200, 3200, 35.6)]
    assert "MISS" in batch.markdown(args(), "m", slow, [])


@pytest.mark.unit
def test_the_queue_path_reports_each_band_and_the_median_of_their_pairs() -> None:
    pairs = [Pair(100.0, 96.0, 3200, 3200, 33.3, queue_tok_s=100.0, queue_bulk_tok_s=90.0),
             Pair(100.0, 96.0, 3200, 3200, 33.3, queue_tok_s=100.0, queue_bulk_tok_s=110.0),
             Pair(100.0, 96.0, 3200, 3200, 33.3, queue_tok_s=80.0, queue_bulk_tok_s=80.0)]
    md = batch.markdown(args(), "m", pairs, [])
    assert "| 100.0, 90.0 (0.900) |" in md and "bulk ÷ interactive" in md and "median of pairs 1.000 (" in md
    assert "median of pairs 1.000 (" not in batch.markdown(args(), "m", [Pair(100.0, 96.0, 3200, 3200, 33.3)], [])


@pytest.mark.slow
@pytest.mark.e2e
def test_the_quick_run_measures_memory_and_throughput(tmp_path: Path) -> None:
    assert batch.main(["--quick", "--out", str(tmp_path), "--no-reexec"]) == 0
    data = json.loads((tmp_path / "batch.json").read_text())
    (pair,) = data["pairs"]
    assert pair["raw_tokens"] == pair["batch_tokens"] > 0 and pair["raw_tok_s"] > 0 and pair["batch_tok_s"] > 0
    (mem,) = data["memory"]
    assert mem["lines"] == 100 and mem["input_file"] >= mem["input_file_bytes"] > 0
    assert mem["results_while_running"] > mem["output_file_bytes"] > 0 and mem["batch_record"] > 0
    assert "batch ÷ raw" in (tmp_path / "batch.md").read_text()
