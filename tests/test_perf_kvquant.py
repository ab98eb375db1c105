"""``python3 -m tests.perf.kvquant``, KV quantization's benchmark: how it judges its figures, and (slow) its quick run
end to end on the tiny kvq model.

No wall-clock thresholds: only that every result is there and consistent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.perf import kvquant
from tests.perf.kvquant import Plan, Results, Side


def results(rows8: int, tps8: float, step8: float) -> Results:
    return Results(Plan(), "bundled", [Side(0, 1024, 1024.0, 8, 100.0, 1.0),
                                       Side(8, 544, 544.0, rows8, tps8, step8, 1e-4, 0.99),
                                       Side(4, 290, 288.0, 28, 200.0, 1.2, 1e-2, 0.9)])


@pytest.mark.unit
def test_each_target_is_judged_against_the_float_side_of_the_same_run() -> None:
    good = {what: ok for what, _, _, ok in results(15, 150.0, 1.2).targets()}
    assert all(good.values()), good
    bad = {what: ok for what, _, _, ok in results(14, 120.0, 1.3).targets()}
    # 14 rows is 1.75x against 0.95 x 1.88x; 1.2x the tok/s; a row-step 1.3x float's
    assert not bad["rows at the same headroom, 8 bits ÷ float"]
    assert not bad["tok/s at the float cache's full N (8), 8 bits ÷ float"]
    assert not bad["a decode step per row at N=8, 8 bits ÷ float"]
    assert bad["KV bytes a token, 4 bits: measured against the formula (288)"]  # 290: within 2 %
    assert bad["rows at the same headroom, 4 bits ÷ float"]
    md = kvquant.markdown(results(14, 120.0, 1.3))
    assert "| rows at the same headroom, 8 bits ÷ float | 1.75x | ≥ 0.95 x 1.88x | MISS |" in md
    assert "| 4 bits | 290 | 288 | 28 | 200.0 | 1.200 | 1.00e-02 | 0.900 |" in md


@pytest.mark.slow
def test_the_quick_run_writes_every_figure(tmp_path: Path) -> None:
    assert kvquant.main(["--quick", "--out", str(tmp_path), "--no-reexec"]) == 0
    data = json.loads((tmp_path / "kvquant.json").read_text())
    sides = {s["bits"]: s for s in data["sides"]}
    assert set(sides) == {0, 4, 8}
    assert all(s["tps"] > 0 and s["step_ms_per_row"] > 0 for s in sides.values())
    assert sides[0]["rows"] < sides[8]["rows"] < sides[4]["rows"]
    assert sides[8]["mean_kl"] >= 0 and 0 <= sides[8]["top1"] <= 1
    assert len(data["targets"]) == 7
    assert (tmp_path / "kvquant.md").read_text().startswith("# KV cache quantization in the batch")
