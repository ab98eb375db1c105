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
    assert "| 4 bits | 290 | 288 | 28 | 200.0 | 1.200 | 0.000 | 1.00e-02 | 0.900 |" in md


@pytest.mark.unit
def test_paired_runs_are_judged_by_the_median_of_their_own_ratios() -> None:
    r = results(15, 150.0, 1.2)
    # A machine slowing down run by run: each pair's 8 bits ÷ float is 1.5x tok/s and 1.1x a step, though the
    # medians of each side alone (float 100, 8 bits 120) would say 1.2x.
    r.side(0).tps_runs, r.side(8).tps_runs = [100.0, 80.0, 300.0], [150.0, 120.0, 450.0]
    r.side(0).step_runs, r.side(8).step_runs = [1.0, 2.0, 4.0], [1.1, 2.2, 4.4]
    assert r.paired(8, "tps") == pytest.approx(1.5) and r.paired(8, "step") == pytest.approx(1.1)
    judged = {what: (value, ok) for what, value, _, ok in r.targets()}
    assert judged["tok/s at the float cache's full N (8), 8 bits ÷ float"] == ("1.50x", True)
    assert judged["a decode step per row at N=8, 8 bits ÷ float"] == ("1.10x", True)


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


@pytest.mark.unit
def test_the_gpu_run_refuses_a_machine_without_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        pytest.skip("this machine has a GPU")
    assert kvquant.main(["--device", "gpu", "--out", str(tmp_path), "--no-reexec"]) == 2
    assert "--device gpu, but MLX has no GPU here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
