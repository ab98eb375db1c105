"""``python3 -m tests.perf.speculative``, speculative decoding's research benchmark: how it judges its fully loaded
runs (never slower than plain decoding). No wall-clock thresholds: made-up figures only."""

from __future__ import annotations

import pytest

from tests.perf import speculative
from tests.perf.speculative import Report

pytestmark = pytest.mark.unit


def report(pairs: dict[int, list[tuple[float, float]]]) -> Report:
    r = Report("openblas", 0.8, 128)
    for n, runs in pairs.items():
        r.loaded_pairs[n] = runs
        r.loaded[n] = (sorted(p for p, _ in runs)[len(runs) // 2], sorted(q for _, q in runs)[len(runs) // 2])
        r.loaded_cpu[n] = 1.0
    return r


def test_the_fully_loaded_verdict_is_the_median_of_paired_ratios_against_never_slower() -> None:
    # Pairs run one after the other: a pair slowed by other work is one ratio of several, not the best of a side.
    assert speculative.loaded_ratio([(100.0, 99.0), (50.0, 80.0), (100.0, 50.0)]) == pytest.approx(0.99)
    assert speculative.verdict(0.97) == "PASS" and speculative.verdict(0.96) == "MISS"
    md = speculative.markdown(report({8: [(100.0, 99.0), (50.0, 80.0), (100.0, 50.0)],
                                      32: [(200.0, 150.0), (210.0, 160.0), (190.0, 180.0)]}))
    assert "| 8 | 100.0 | 80.0 | 0.99, 1.60, 0.50 | 0.99 | >= 0.97 | **PASS** | 1.00 |" in md
    assert "| 32 | 200.0 | 160.0 | 0.75, 0.76, 0.95 | 0.76 | >= 0.97 | **MISS** | 1.00 |" in md
    assert md.index("**PASS**") < md.index("Distinct shapes")  # the verdict comes first
    assert "Bursts of N requests" not in md  # a --loaded-only run has none
