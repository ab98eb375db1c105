"""Redis names: the ``{rid}`` hash tag, the deployment prefix, stream entry ids, the public channel name."""

from __future__ import annotations

import re

import pytest
from redis.crc import key_slot

from mlxq.api.protocol.keys import Keys, log_entry_id
from mlxq.api.schema import REQUEST_ID_PATTERN

pytestmark = pytest.mark.unit

PER_JOB = ("events", "log", "cancel", "lease", "job", "result", "tries")


def job_names(keys: Keys, rid: str) -> dict[str, str]:
    return {kind: getattr(keys, kind)(rid) for kind in PER_JOB}


def test_events_channel_name_is_public_format() -> None:
    assert Keys().events("abc123") == "mlxq:{abc123}:events"
    assert Keys("prod").events("r-1") == "prod:{r-1}:events"


def test_default_prefix_is_mlxq() -> None:
    assert Keys().prefix == "mlxq"


def test_per_job_names() -> None:
    assert job_names(Keys("p"), "r") == {
        "events": "p:{r}:events",
        "log": "p:{r}:log",
        "cancel": "p:{r}:cancel",
        "lease": "p:{r}:lease",
        "job": "p:{r}:job",
        "result": "p:{r}:result",
        "tries": "p:{r}:tries",
    }


def test_shared_names() -> None:
    keys = Keys("p")
    assert keys.queue("llama-3") == "p:queue:llama-3"
    assert keys.cancel_channel() == "p:cancel"


@pytest.mark.parametrize("rid", ["r", "0123456789abcdef", "a.b:c-d_e"])
def test_per_job_names_share_the_rid_hash_tag(rid: str) -> None:
    names = job_names(Keys("mlxq"), rid).values()
    for name in names:
        # The first {...} in the name is the hash tag, and it is exactly the rid.
        assert re.search(r"\{([^}]*)\}", name).group(1) == rid  # type: ignore[union-attr]
    assert len(set(names)) == len(PER_JOB)
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert key_slot(next(iter(names)).encode()) == key_slot(rid.encode())


def test_different_jobs_get_different_names() -> None:
    a, b = job_names(Keys(), "a"), job_names(Keys(), "b")
    assert set(a.values()).isdisjoint(b.values())


def test_prefix_separates_deployments() -> None:
    one, two = Keys("one"), Keys("two")
    names_one = [*job_names(one, "r").values(), one.queue("m"), one.cancel_channel()]
    names_two = [*job_names(two, "r").values(), two.queue("m"), two.cancel_channel()]
    assert set(names_one).isdisjoint(names_two)
    assert all(n.startswith("one:") for n in names_one)
    assert all(n.startswith("two:") for n in names_two)


def test_request_ids_cannot_break_the_hash_tag() -> None:
    assert re.match(REQUEST_ID_PATTERN, "a{b") is None
    assert re.match(REQUEST_ID_PATTERN, "a}b") is None


def test_keys_is_frozen() -> None:
    keys = Keys("p")
    with pytest.raises(AttributeError):
        keys.prefix = "q"  # type: ignore[misc]


@pytest.mark.parametrize("seq", [0, 1, 9, 10, 12345, 2**40])
def test_log_entry_id_names_the_seq(seq: int) -> None:
    assert log_entry_id(seq) == f"{seq}-1"


def test_log_entry_ids_order_like_seqs() -> None:
    # Redis orders stream ids numerically by (ms, seq): ids for seq 2 < 10 < 100.
    def as_tuple(entry: str) -> tuple[int, int]:
        ms, n = entry.split("-")
        return int(ms), int(n)

    seqs = [0, 1, 2, 10, 100]
    assert sorted(seqs, key=lambda s: as_tuple(log_entry_id(s))) == seqs
    assert as_tuple(log_entry_id(0)) > (0, 0)  # Redis rejects the id 0-0
