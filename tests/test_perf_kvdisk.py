"""``python3 -m tests.perf.kvdisk``, the disk tier's benchmark: how it judges its runs and restarts, and (slow) its
quick run end to end (an embedded Redis, worker processes on the tiny model with the tier on and off, the index
scan, workers stopped and killed between two turns).

No wall-clock thresholds: only that every result is there and consistent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.perf import kvdisk
from tests.perf.kvdisk import IndexScan, Plan, Results, Run, Turn2

# Tiers: unit, but for the quick runs (slow, e2e: a Redis and worker processes); tests/conftest.py marks
# the rest.


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


def turn2(mode: str, ttft_ms: float, rnd: int = 0, exact: bool | None = True) -> Turn2:
    return Turn2(mode, 1500, 1, 0, 2.0, ttft_ms, ttft_ms - 1, 0 if mode == "cold" else 1, "text",
                 None if mode == "cold" else exact, rnd)


def restarts(*turns: Turn2) -> Results:
    return Results(Plan(), "m", [], None, "bundled", list(turns))


def test_each_way_of_restarting_is_judged_by_median_ttfts_and_its_text() -> None:
    r = restarts(turn2("sigterm", 50.0), turn2("kill9", 100.0), turn2("cold", 1000.0),
                 turn2("sigterm", 70.0, 1), turn2("kill9", 90.0, 1), turn2("cold", 1200.0, 1),
                 turn2("sigterm", 900.0, 2), turn2("kill9", 95.0, 2), turn2("cold", 1100.0, 2))
    assert r.modes() == ["sigterm", "kill9"] and r.ttft_ms("cold") == 1100.0  # medians: one slow round is not all
    assert r.speedup("sigterm") == pytest.approx(1100 / 70) and r.speedup("kill9") == pytest.approx(1100 / 95)
    assert r.passed  # only the phase that ran is judged
    md = kvdisk.markdown(r)
    assert "| 15.7x | ≥ 10x | PASS |" in md and "Index:" not in md and "never repeats" not in md
    slow = restarts(turn2("sigterm", 50.0), turn2("kill9", 200.0), turn2("cold", 1000.0))
    assert not slow.passed and "| 5.0x | ≥ 10x | MISS |" in kvdisk.markdown(slow)
    wrong = restarts(turn2("sigterm", 50.0), turn2("cold", 1000.0), turn2("sigterm", 50.0, 1, False),
                     turn2("cold", 1000.0, 1))
    assert not wrong.exact("sigterm") and not wrong.passed and "| differs | same | MISS |" in kvdisk.markdown(wrong)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)  # a research run, beside the suite's other files: a bound, not a target
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
    turns = {t["mode"]: t for t in data["restarts"]}  # one round of each
    assert len(data["restarts"]) == 3 and sorted(turns) == ["cold", "kill9", "sigterm"]
    for mode, exit_code in (("sigterm", 0), ("kill9", -9)):  # the first worker's entry outlived it, and was read
        t = turns[mode]
        assert t["first_exit"] == exit_code and t["first_entries"] >= 1 and t["disk_hits"] == 1
        assert t["exact"] and t["text"] == turns["cold"]["text"] and t["ttft_ms"] > 0
        assert t["prompt_tokens"] == turns["cold"]["prompt_tokens"] > Plan.quick().restart_system_tokens
    assert turns["cold"]["disk_hits"] == 0 and turns["cold"]["ttft_ms"] > 0
    assert set(data["restart"]) == {"sigterm", "kill9"} and all(v["exact"] for v in data["restart"].values())
    assert (tmp_path / "kvdisk.md").read_text().startswith("# The prefix cache on disk")
    assert not list(tmp_path.glob("mlxq-kv*"))  # its directories of entries are gone


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)  # a research run, beside the suite's other files: a bound, not a target
def test_the_restart_phase_runs_alone(tmp_path: Path) -> None:
    assert kvdisk.main(["--quick", "--phases", "restart", "--out", str(tmp_path), "--no-reexec"]) == 0
    data = json.loads((tmp_path / "kvdisk.json").read_text())
    assert data["runs"] == [] and data["index"] is None and len(data["restarts"]) == 3
