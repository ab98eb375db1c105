"""Models loaded on demand as producers see them: a model a live worker can load counts as served (require_worker,
/v1/models), marked not loaded; `mlxq status` says where it loads; one whose load failed is not offered."""

from __future__ import annotations

import time

import pytest

from mlxq.api.gateway.app import _card
from mlxq.api.registry import models_of
from mlxq.api.schema import ModelState, ModelStatus, WorkerStatus
from mlxq.api.status import Report, render

pytestmark = pytest.mark.unit


def worker(wid: str, *models: ModelStatus, draining: bool = False) -> WorkerStatus:
    now = time.time()
    return WorkerStatus(id=wid, host="h", pid=1, version="0", started_at=now, updated_at=now, draining=draining,
                        models=list(models))


def model(name: str, state: ModelState, loadable: bool = True) -> ModelStatus:
    return ModelStatus(name=name, state=state, capacity=8, loadable=loadable)


def test_a_loadable_model_counts_as_offered_but_not_loaded() -> None:
    models = models_of([worker("w1", model("pinned", ModelState.SERVING, False), model("cold", ModelState.UNLOADED)),
                        worker("w2", model("cold", ModelState.LOADING), model("gone", ModelState.LOAD_FAILED))])
    assert (models["pinned"].workers, models["pinned"].loadable, models["pinned"].offered) == (1, 0, True)
    assert (models["cold"].workers, models["cold"].loadable, models["cold"].offered) == (0, 2, True)
    assert not models["gone"].offered  # its load failed: no worker will run its jobs
    card = _card(models["cold"], anthropic=False)
    assert (card["loaded"], card["loadable_on"], card["workers"]) == (False, 2, 0)
    assert _card(models["pinned"], anthropic=False)["loaded"] is True


def test_a_draining_worker_offers_no_model_to_load() -> None:
    models = models_of([worker("w1", model("cold", ModelState.UNLOADED), draining=True)])
    assert not models["cold"].offered


def test_status_says_where_a_model_not_loaded_would_load() -> None:
    workers = [worker("w1", model("cold", ModelState.UNLOADED))]
    text = render(Report("redis://x", "mlxq", time.time(), {}, models_of(workers), workers, []))
    (row,) = [line for line in text.splitlines() if line.startswith("cold ")]
    assert row.split()[-3:] == ["loadable", "on", "1"]
    assert "unloaded" in text  # the worker's row says the model's state
