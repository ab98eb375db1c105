"""The slots a model's bulk band leaves to its interactive jobs (worker/reserve.py): as many as the model held at
its recent peak and holds no more, for the hold's length; a claim's bulk quota is its room less them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mlxq.api.protocol.claim import DueEntry, EntryStatus
from mlxq.worker.config import WorkerConfig
from mlxq.worker.reserve import InteractiveReserve
from mlxq.worker.service import ModelService

pytestmark = pytest.mark.unit


def test_the_slots_of_the_recent_peak_not_held_now_are_reserved_for_the_hold() -> None:
    r = InteractiveReserve(hold_s=1.0)
    r.note(3, now=10.0)
    assert (r.peak(10.0), r.reserved(10.0)) == (3, 0)
    r.note(1, now=10.5)  # two ended: their clients' next jobs find their slots
    assert r.reserved(10.9) == 2
    r.note(2, now=11.0)  # one came back
    assert r.reserved(11.4) == 1
    assert r.reserved(11.6) == 0  # three were last held at 10.5 (two since 11.0): past the hold
    r.note(0, now=11.8)
    assert r.reserved(12.7) == 2 and r.reserved(12.9) == 0


def test_no_hold_reserves_nothing() -> None:
    r = InteractiveReserve(hold_s=0.0)
    r.note(4, now=1.0)
    r.note(0, now=1.0)
    assert r.reserved(1.0) == 0


@dataclass
class Engine:
    """What ModelService's room and claims use of an engine."""

    capacity: int
    dead: bool = False

    def claim_capacity(self) -> int:
        return self.capacity

    def paused(self) -> int:
        return 0

    def expect(self, n: int, within_s: float, groups: object, interactive: int = 0) -> None:
        pass


def entry(rid: str, bulk: bool = False) -> DueEntry:
    return DueEntry(rid, "q", EntryStatus.STARTED, "", attempt=1, model="m", bulk=bulk)


def test_a_models_bulk_room_leaves_the_slots_its_interactive_jobs_just_freed() -> None:
    config = WorkerConfig.from_env({"MLXQ_MODEL": "/models/m", "MLXQ_MODEL_NAME": "m", "MLXQ_BATCH_CAPACITY": "8",
                                    "MLXQ_BULK_HOLD_MS": "600000"})
    service = ModelService(config.served[0], config)
    engine = Engine(capacity=8)
    service.engine = engine  # type: ignore[assignment]
    chats = [entry(f"c{i}") for i in range(3)]
    service.claimed([*chats, entry("b0", bulk=True)])
    engine.capacity = 4
    assert service.bulk_room() == 4  # every interactive job it held is still here
    for e in chats[:2]:
        service.release(e)
    engine.capacity = 6
    assert (service.room(), service.bulk_room()) == (6, 4)  # two slots stay for the next interactive jobs
    service.claimed([entry("c3")])
    engine.capacity = 5
    assert service.bulk_room() == 4
