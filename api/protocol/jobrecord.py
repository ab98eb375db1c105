"""The job and result records, as arq stores them: JSON envelopes (never pickle) under the deployment's prefix.

A producer writes a job record (:func:`job_record`); a worker reads it (:func:`read_job`) and writes the ended
job's result record (:func:`result_record`), which ``arq.jobs.Job.result()`` reads. Nothing here imports arq:
a producer installs without it (the worker's seam to arq itself is ``worker/arqseam.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any

__all__ = ["JOB_FUNCTION", "Envelope", "KeptResult", "job_record", "load_record", "read_job", "read_result",
           "result_record"]

JOB_FUNCTION = "generate"  # the arq function name of every mlxq job


def job_record(payload: dict[str, Any], enqueue_ms: int, affinity: str | Sequence[str] = "") -> bytes:
    """arq's job record for a job of ours: JSON, never pickle. It ends with the job's affinity keys (if any, hex,
    deepest first, comma-separated: api/affinity.py) and its enqueue time, ``"ak":"<key>[,<key>...]","et":<ms>}``,
    where CLAIM reads them (a short GETRANGE of the tail, never the whole record)."""
    envelope: dict[str, Any] = {"t": None, "f": JOB_FUNCTION, "a": [payload], "k": {}}
    keys = [affinity] if isinstance(affinity, str) else list(affinity)
    if any(keys):
        envelope["ak"] = ",".join(k for k in keys if k)
    envelope["et"] = enqueue_ms
    return json.dumps(envelope, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Envelope:
    """A job record as read back: its one payload, or why it cannot be run (``problem``)."""

    payload: Any
    enqueue_ms: int
    problem: str = ""
    affinity: str = ""  # the job's deepest affinity key (api/affinity.py); "": none
    keys: tuple[str, ...] = ()  # all its affinity keys, deepest first (the first is ``affinity``)


def read_job(data: bytes, max_bytes: int) -> Envelope:
    """Parse a job record; never raises (a malformed one comes back with a ``problem``)."""
    now = int(time.time() * 1000)
    if len(data) > max_bytes:
        return Envelope(None, now, f"the job has {len(data)} bytes; the limit is {max_bytes}")
    try:
        d = json.loads(data)
        _check_envelope(d)
    except (ValueError, TypeError, RecursionError) as exc:
        reason = str(exc) if len(str(exc)) <= 300 else str(exc)[:300] + "..."
        return Envelope(None, now, f"undecodable job: {reason}")
    args, kwargs = d["a"], d["k"]
    if len(args) != 1 or kwargs:
        return Envelope(None, d["et"], "undecodable job: the job must carry one payload")
    ak = d.get("ak")
    keys = tuple(k for k in ak.split(",") if k) if isinstance(ak, str) else ()
    return Envelope(args[0], d["et"], affinity=keys[0] if keys else "", keys=keys)


def _check_envelope(d: Any) -> None:
    if not isinstance(d, dict):
        raise ValueError("the job is not a JSON object")
    checks = {"f": (str,), "a": (list,), "k": (dict,), "t": (int, type(None)), "et": (int,)}
    for key, types in checks.items():
        value = d.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(f"malformed job envelope: {key!r} is {type(value).__name__}")
    if d["f"] != JOB_FUNCTION:
        raise ValueError(f"unknown job function {d['f'][:64]!r}")


def result_record(rid: str, *, attempt: int, ok: bool, event_json: str, enqueue_ms: int, start_ms: int,
                  queue: str, text: str = "", reasoning: str = "") -> bytes:
    """An ended job's kept result: arq's result record (what ``Job.result()`` reads: its terminal event as the
    result, without the job's arguments, which arq would keep again), plus the last run's ``text`` (``tx``) and
    ``reasoning`` (``rs``), so the whole result is read back by id long after the job's log expired
    (:func:`read_result`). Written around the event's own JSON rather than dumping a dict: one per job, on the
    event loop."""
    return (f'{{"t":{attempt},"f":{encode_basestring(JOB_FUNCTION)},"a":[],"k":{{}},"et":{enqueue_ms},'
            f'"s":{"true" if ok else "false"},"r":{event_json},"st":{start_ms},"ft":{int(time.time() * 1000)},'
            f'"q":{encode_basestring(queue)},"id":{encode_basestring(rid)},"tx":{encode_basestring(text)},'
            f'"rs":{encode_basestring(reasoning)}}}').encode()


@dataclass(frozen=True, slots=True)
class KeptResult:
    """An ended job's result as kept (:func:`result_record`): its terminal event (a dict, as logged), the last
    run's text and reasoning, and when it was enqueued, started and finished (epoch ms)."""

    end: dict[str, Any]
    text: str
    reasoning: str
    enqueue_ms: int
    start_ms: int
    finish_ms: int


def read_result(data: bytes) -> KeptResult:
    """A kept result record; ``ValueError`` for what is none (a record without a terminal event)."""
    d = json.loads(data)
    if not isinstance(d, dict) or not isinstance(d.get("r"), dict):
        raise ValueError("not a result record")
    return KeptResult(d["r"], str(d.get("tx", "")), str(d.get("rs", "")), int(d.get("et") or 0),
                      int(d.get("st") or 0), int(d.get("ft") or 0))


def load_record(data: bytes) -> dict[str, Any]:
    """A record's JSON, as arq's deserializer hands it back."""
    d: dict[str, Any] = json.loads(data)
    return d
