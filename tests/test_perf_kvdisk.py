"""``python3 -m tests.perf.kvdisk``, the disk tier's overhead benchmark: how it judges its runs, and (slow) its quick
run end to end (an embedded Redis, worker processes on the tiny model with the tier on and off, the index scan).

No wall-clock thresholds: only that every result is there and consistent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.perf import kvdisk
from tests.perf.kvdisk import IndexScan, Plan, Results, Run

pytestmark = pytest.mark.unit


def run(rnd: int, disk: bool, tokens: int, seconds: float) -> Run:
    return Run(rnd, disk, 8, tokens, 100, seconds, 1.0, 16 if disk else 0, 0, 0, 8 if disk else 0, 1 << 20)


def results(*runs: Run) -> Results:
    return Results(Plan(rounds=2), "m", list(runs), IndexScan(4, 10, 1.0, 1.0, 2.0), "bundled")


def test_each_round_is_judged_by_its_own_pair_and_the_best_runs() -> None:
    r = results(run(0, True, 960, 10.0), run(0, False, 1000, 10.0),  # 0.96
                run(1, False, 1000, 10.0), run(1, True, 1000, 10.0))  # 1.0
    assert r.pairs() == [pytest.approx(0.96), pytest.approx(1.0)]
    assert r.median_pairs() == pytest.approx(0.98) and r.best() == pytest.approx(1.0)
    assert r.passed
    slow = results(run(0, True, 900, 10.0), run(0, False, 1000, 10.0), run(1, False, 1000, 10.0),
                   run(1, True, 950, 10.0))
    assert slow.median_pairs() == pytest.approx(0.925) and not slow.passed
    md = kvdisk.markdown(slow)
    assert "| 0.925 | ≥ 0.97 | MISS |" in md and md.count("| on |") == 2


@pytest.mark.slow
@pytest.mark.e2e
def test_the_quick_run_measures_both_tiers_and_the_index(tmp_path: Path) -> None:
    assert kvdisk.main(["--quick", "--out", str(tmp_path), "--no-reexec"]) == 0
    data = json.loads((tmp_path / "kvdisk.json").read_text())
    runs = data["runs"]
    assert sorted((r["round"], r["disk"]) for r in runs) == [(0, False), (0, True), (1, False), (1, True)]
    for r in runs:
        assert r["tokens"] > 0 and r["seconds"] > 0 and r["disk_hits"] == 0  # nothing repeats: nothing hits
        assert (r["writes"] > 0) is r["disk"] and (r["disk_entries"] > 0) is r["disk"]
    assert len(data["pairs"]) == 2 and data["median_pairs"] > 0
    assert data["index"]["entries"] == Plan.quick().index_entries and data["index"]["warm_ms"] > 0
    assert (tmp_path / "kvdisk.md").read_text().startswith("# The prefix cache on disk")
    assert not list(tmp_path.glob("mlxq-kv*"))  # its directories of entries are gone
