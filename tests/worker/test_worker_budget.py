"""The weight budget of on-demand loading (worker/budget.py): least recently used idle models leave first, pinned
and busy ones never; idle models past the timeout; a budget too small for the models; sizes as settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxq.api.errors import ConfigError
from mlxq.worker.budget import WeightBudget, budget_problem, weights_bytes
from mlxq.worker.config import parse_size

pytestmark = pytest.mark.unit


def budget(limit: int | None) -> WeightBudget:
    b = WeightBudget(limit)
    b.add("pinned", 10, pinned=True)
    for name, size in (("a", 10), ("b", 10), ("c", 10), ("big", 20)):
        b.add(name, size, pinned=False)
    b.loaded("pinned", 0.0)
    return b


def test_a_model_that_fits_unloads_nothing() -> None:
    b = budget(30)
    b.loaded("a", 1.0)
    assert b.victims("b", busy=set()) == []
    assert budget(None).victims("big", busy=set()) == []  # no bound


def test_the_least_recently_used_idle_model_leaves_first_and_only_as_many_as_needed() -> None:
    b = budget(30)
    b.loaded("a", 1.0)
    b.loaded("b", 2.0)
    b.unloaded("a")
    b.loaded("a", 3.0)  # a loaded again: b is now the least recently used
    assert b.in_use == 30
    assert b.victims("c", busy=set()) == ["b"]
    b.used("b", 4.0)  # b held a job since: a is the colder one
    assert b.victims("c", busy=set()) == ["a"]
    assert b.victims("big", busy=set()) == ["a", "b"]  # 20 bytes need both out


def test_pinned_and_busy_models_never_leave_and_a_model_that_cannot_fit_waits() -> None:
    b = budget(30)
    b.loaded("a", 1.0)
    b.loaded("b", 2.0)
    assert b.victims("c", busy={"a"}) == ["b"]
    assert b.victims("c", busy={"a", "b"}) is None
    assert b.victims("big", busy={"a"}) is None  # b alone frees 10 of the 20 it needs


def test_idle_models_past_the_timeout_are_chosen_coldest_first_and_never_pinned_or_busy() -> None:
    b = budget(None)
    b.loaded("a", 1.0)
    b.loaded("b", 5.0)
    b.loaded("c", 8.0)
    assert b.idle(now=10.0, idle_s=4.0, busy=set()) == ["a", "b"]
    assert b.idle(now=10.0, idle_s=4.0, busy={"a"}) == ["b"]
    assert b.idle(now=100.0, idle_s=0.0, busy=set()) == []  # 0: idle models stay
    assert "pinned" not in b.idle(now=100.0, idle_s=1.0, busy=set())


def test_a_budget_must_hold_the_pinned_models_and_the_smallest_loadable_one() -> None:
    assert budget_problem(None, {"p": 10}, {"a": 5}) is None
    assert budget_problem(15, {"p": 10}, {"a": 5, "b": 50}) is None
    problem = budget_problem(14, {"p": 10}, {"a": 5, "b": 50})
    assert problem is not None and problem.startswith("MLXQ_MODEL_MEMORY=14B is too small: the smallest loadable "
                                                      "model, a, needs 5B beside the pinned models' 10B")
    assert budget_problem(1, {}, {}) is None  # nothing loads on demand


def test_weights_are_the_safetensors_files_of_a_local_directory(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 20)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 999)
    assert weights_bytes(str(tmp_path)) == 120
    assert weights_bytes("org/name") is None  # a hub id: not known before download


@pytest.mark.parametrize("raw,expected", [("24GiB", 24 << 30), ("1.5 GB", 1_500_000_000), ("512mib", 512 << 20),
                                          ("1000", 1000), ("", None)])
def test_sizes_read_with_their_units(raw: str, expected: int | None) -> None:
    assert parse_size("MLXQ_MODEL_MEMORY", raw) == expected


@pytest.mark.parametrize("raw", ["lots", "12 parsecs", "-1GiB", "0"])
def test_a_size_that_does_not_parse_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="MLXQ_MODEL_MEMORY="):
        parse_size("MLXQ_MODEL_MEMORY", raw)
