"""The bulk band on the producer side, with no Redis: the request field (``as_bulk``, what a batch's feeder calls),
the names its jobs queue under, ENQUEUE's keys for a bulk job, and ``mlxq status`` showing the band apart."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mlxq.api.protocol.keys import BULK_MARK, Keys, band_model, model_band
from mlxq.api.protocol.producer import Enqueue
from mlxq.api.registry import ModelInfo, QueueInfo, models_of
from mlxq.api.schema import GenerateRequest, ModelState, ModelStatus, WorkerStatus, as_bulk
from mlxq.api.status import Report, live, render

pytestmark = pytest.mark.unit

KEYS = Keys("p")


def test_as_bulk_puts_a_request_in_the_bulk_band_and_keeps_the_rest() -> None:
    req = GenerateRequest(model="m", prompt="x", priority=3, tenant="acme")
    assert req.bulk is False
    bulk = as_bulk(req)
    assert bulk.bulk is True and bulk.model_dump(exclude={"bulk"}) == req.model_dump(exclude={"bulk"})
    assert "bulk" not in req.model_dump(exclude_defaults=True)  # an interactive job's record is as before


def test_a_model_name_ending_with_the_bulk_mark_is_refused() -> None:
    with pytest.raises(ValidationError, match="bulk"):
        GenerateRequest(model="m" + BULK_MARK, prompt="x")


def test_a_bulk_queue_names_its_model_and_tenant_and_band() -> None:
    for tenant in ("default", "acme"):
        queue = KEYS.queue("org/m:q4", tenant, bulk=True)
        assert queue != KEYS.queue("org/m:q4", tenant)
        model, got = KEYS.queue_of(queue)
        assert got == tenant and model_band(model) == ("org/m:q4", True) and band_model("org/m:q4", True) == model
    assert model_band(KEYS.queue_of(KEYS.queue("m"))[0]) == ("m", False)


def test_enqueue_puts_a_bulk_job_on_the_bands_queue_and_backlog_and_wakes_the_models_workers() -> None:
    job = Enqueue("r1", b"{}", "m", "acme", 1, 0, 0, 1000, bulk=True)
    keys, args = job.call(KEYS)
    assert KEYS.queue("m", "acme", bulk=True) in keys and KEYS.backlog("m~bulk") in keys
    assert KEYS.wake_channel("m") in args and "m~bulk" in args  # the model's cap counts the band's queues
    plain_keys, _ = Enqueue("r1", b"{}", "m", "acme", 1, 0, 0, 1000).call(KEYS)
    assert KEYS.queue("m", "acme") in plain_keys and KEYS.backlog("m") in plain_keys


def _worker(bulk: int) -> WorkerStatus:
    return WorkerStatus(id="w1", host="h", pid=1, version="v", started_at=0.0, updated_at=0.0,
                        models=[ModelStatus(name="m", state=ModelState.SERVING, capacity=8, running=5, waiting=1,
                                            bulk=bulk)])


def test_live_counts_a_workers_bulk_jobs_from_the_bands_queues() -> None:
    claimed = {("w1", "m"): 2, ("w1", "m~bulk"): 4}  # the running list names each job's queue
    (w,) = live([_worker(0)], claimed)
    (m,) = w.models
    assert (m.running, m.waiting, m.bulk) == (5, 1, 4)
    assert models_of([w])["m"].bulk == 4


def test_status_shows_the_bulk_band_apart_in_its_own_column() -> None:
    info = ModelInfo("m", 1, 8, 5, 1, 12.5, False, None, bulk=4)
    queues = {"m": QueueInfo("m", 2, 1.0, {"default": 2}), "m~bulk": QueueInfo("m~bulk", 30, 9.0, {"acme": 30}),
              "only~bulk": QueueInfo("only~bulk", 7, 3.0, {"default": 7})}
    report = Report("redis", "p", 0.0, queues, {"m": info}, [], [])
    lines = render(report).splitlines()
    header = next(ln for ln in lines if ln.startswith("MODEL ")).split()
    assert header[-3:] == ["BULK", "TOK/S", "IMAGES"]
    row = next(ln for ln in lines if ln.startswith("m ")).split()
    assert row[header.index("BULK")] == "30/4" and row[header.index("QUEUED")] == "2"
    only = next(ln for ln in lines if ln.startswith("only ")).split()
    assert only[1] == "0" and only[header.index("BULK")] == "7/0"  # a model with only bulk jobs queued
    assert not any(ln.startswith("m~bulk") for ln in lines)
    models = {m["name"]: m for m in report.to_json()["models"]}
    assert set(models) == {"m", "only"}
    assert (models["m"]["queued"], models["m"]["bulk_queued"], models["m"]["bulk"]) == (2, 30, 4)
