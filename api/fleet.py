"""The fleet as the dashboard shows it, read from Redis through the client (no worker code, no writes but the
two actions).

:func:`overview`: models and their queues (depth by priority, the oldest wait; a model's bulk band a row apart),
tenants (policy and live use: jobs queued and running, tokens a minute, share of the work), live and lost workers,
running and recent jobs, dead letters and each model's history (``api.history``). :func:`job`: one job's record, tries,
lease and events from its replay log; prompts and outputs only for ``full`` (an admin), sizes otherwise.
:func:`retry_dead_letter`: a dead letter's job submitted again through the client's enqueue path.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from typing import Any

from .client import Client
from .errors import BadRequest, JobNotFound
from .follow import kept_events
from .history import recent, series
from .protocol.jobrecord import read_job
from .protocol.keys import Keys, model_band
from .protocol.notify import report
from .registry import models_of
from .schema import PRIORITY_MIN, GenerateRequest, decode_event
from .status import claimed, live

__all__ = ["job", "overview", "retry_dead_letter"]

_LOST_FOR_S = 3600.0  # a worker gone silent is listed as lost this long (then readers prune it)
_QUEUE_READ = 200  # queue entries read per model for the depth by priority
_DEAD_SHOWN = 100
_RUNNING_SHOWN = 200
_READ_LIMIT = 1 << 30  # a job record is read back whatever its size (the dashboard only shows it)
# A request's fields anyone with a key sees: its parameters, never its content (prompt, messages, tools, stop
# strings, metadata, response format).
_PARAMETERS = frozenset({"id", "model", "max_tokens", "fit_max_tokens", "temperature", "top_p", "top_k", "min_p",
                         "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "priority",
                         "expires_in", "reasoning", "enable_thinking", "logprobs", "top_logprobs"})


async def overview(client: Client) -> dict[str, Any]:
    """Everything the dashboard's main view shows, as JSON."""
    redis, keys, now = client.redis, client.keys, time.time()
    workers = live(await client.workers(), await claimed(client))  # as of now, as the tenants panel's counts
    queues = {q.model: q for q in await client.queues()}
    served = models_of(workers)
    ended = await recent(redis, keys)
    # A model with no queue and no worker left still shows while its recent jobs do (its charts, its history).
    names = sorted(set(queues) | set(served) | {str(s["model"]) for s in ended if s.get("model")})
    history = await series(redis, keys, names, now)
    models = []
    for name in names:
        q, m = queues.get(name), served.get(name)
        base, bulk = model_band(name)  # a model's bulk band has a row of its own: its queue, history and jobs
        if bulk and base in served:  # in engines (the model's capacity, shared with its interactive jobs)
            m = replace(served[base], name=name, running=served[base].bulk, waiting=0)
        models.append({"name": name, "band": "bulk" if bulk else "interactive",
                       "queued": q.depth if q else 0, "oldest_s": q.oldest_s if q else None,
                       "by_priority": await _by_priority(client, name) if q else {},
                       "served": asdict(m) if m else None,
                       "history": [asdict(p) for p in history[name]]})
    return {"at": now, "redis": client.where, "prefix": keys.prefix, "models": models,
            "tenants": [t.to_json() for t in await client.tenants(list(queues.values()))],
            "workers": [w.model_dump(mode="json") for w in workers],
            "lost": await _lost(client, {w.id for w in workers}, now),
            "running": await _running(client), "recent": ended,
            "dead": await _dead(client), "webhooks": await report(redis, keys)}


async def _by_priority(client: Client, model: str) -> dict[str, int]:
    """Queued jobs of the first entries, by priority (recovered from the score and the record's enqueue time:
    ``api.protocol.keys.queue_score``)."""
    redis, keys = client.redis, client.keys
    entries = await redis.zrange(keys.queue(model), 0, _QUEUE_READ - 1, withscores=True)
    pipe = redis.pipeline(transaction=False)
    for rid, _ in entries:
        pipe.getrange(keys.job(rid.decode()), -32, -1)
    aging_ms = max(1, int(client.config.priority_aging_s * 1000))
    counts: dict[str, int] = {}
    for (_, score), tail in zip(entries, await pipe.execute()):
        et = _enqueue_ms(tail)
        if et is None:
            continue
        priority = str(round((et - score) / aging_ms) + PRIORITY_MIN)
        counts[priority] = counts.get(priority, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -int(kv[0])))


def _enqueue_ms(tail: bytes) -> int | None:
    text = tail.decode(errors="replace")
    at = text.rfind('"et":')
    digits = text[at + 5:].rstrip("}") if at >= 0 else ""
    return int(digits) if digits.isdigit() else None


async def _lost(client: Client, live: set[str], now: float) -> list[dict[str, Any]]:
    """Workers in the registry whose health record expired: they stopped heartbeating without a clean stop."""
    since_ms = int((now - _LOST_FOR_S) * 1000)
    members = await client.redis.zrangebyscore(client.keys.workers(), since_ms, "+inf", withscores=True)
    return [{"id": wid.decode(), "last_seen": score / 1000} for wid, score in members if wid.decode() not in live]


async def _running(client: Client) -> list[dict[str, Any]]:
    """Jobs inside some worker's engine now: id, model and which worker holds its lease."""
    keys = client.keys
    running = await client.redis.hgetall(keys.running())  # type: ignore[misc]
    rids = sorted(r.decode() for r in running)[:_RUNNING_SHOWN]
    pipe = client.redis.pipeline(transaction=False)
    for rid in rids:
        pipe.get(keys.lease(rid))
    leases = await pipe.execute()
    start = len(keys.queue(""))
    jobs = []
    for rid, lease in zip(rids, leases):
        queue = running[rid.encode()].decode().partition(" ")[2]
        owner = lease.decode().rpartition(":")[0] if lease else ""
        jobs.append({"id": rid, "model": queue[start:], "state": "running", "worker": owner})
    return jobs


async def _dead(client: Client) -> list[dict[str, Any]]:
    found = []
    for raw in await client.redis.lrange(client.keys.dead_letters(), 0, _DEAD_SHOWN - 1):  # type: ignore[misc]
        try:
            found.append(json.loads(raw))
        except ValueError:
            continue
    return found


async def job(client: Client, rid: str, *, full: bool) -> dict[str, Any]:
    """One job as its page shows it; :class:`JobNotFound` when Redis holds nothing of it."""
    keys, redis = client.keys, client.redis
    pipe = redis.pipeline(transaction=False)
    pipe.get(keys.job(rid))
    pipe.get(keys.tries(rid))
    pipe.get(keys.lease(rid))
    pipe.hget(keys.running(), rid)
    pipe.exists(keys.cancel(rid))
    pipe.xrange(keys.log(rid))
    record, tries, lease, running, cancel, log = await pipe.execute()
    ended = record is None and not running
    summary = next((s for s in await recent(redis, keys, 500) if s.get("id") == rid), None) if ended else None
    logged = [decode_event(fields[b"e"]) for _, fields in log]
    if ended and not logged and (kept := await client.kept(rid)) is not None:  # its log expired; its result kept
        logged = kept_events(rid, kept)
    if record is None and not logged and summary is None:
        raise JobNotFound(f"job {rid} is unknown, or ended and nothing of it is kept any more")
    events = [e.model_dump(mode="json") for e in logged]
    last = events[-1]["type"] if events else None
    state = ("running" if running else "queued" if record is not None else
             last if last in ("done", "error") else summary["type"] if summary else "unknown")
    # An ended job's tries and lease are gone: its start events and summary still say them.
    started = [e for e in events if e["type"] == "start"]
    tried = max([int(tries or 0), *(e["attempt"] for e in started)])
    worker = (lease.decode().rpartition(":")[0] if lease else started[-1]["worker"] if started
              else summary.get("worker", "") if summary else "")
    return {"id": rid, "state": state, "tries": tried, "worker": worker, "cancel_requested": bool(cancel),
            "request": _request(record, full), "events": [_event(e, full) for e in events], "summary": summary,
            "error": next((e for e in events if e["type"] == "error"), None), "full": full}


def _request(record: bytes | None, full: bool) -> dict[str, Any] | None:
    """The job as enqueued: everything for an admin; its size and parameters, no prompt, for anyone else."""
    if record is None:
        return None
    envelope = read_job(record, _READ_LIMIT)
    payload = envelope.payload if isinstance(envelope.payload, dict) else {}
    shown = {k: v for k, v in payload.items() if full or k in _PARAMETERS}
    return {"bytes": len(record), "enqueue_ms": envelope.enqueue_ms, "payload": shown}


def _event(event: dict[str, Any], full: bool) -> dict[str, Any]:
    if full or event["type"] not in ("token", "done"):
        return event
    if event["type"] == "done":
        return {k: v for k, v in event.items() if k not in ("tool_calls", "stop_sequence")}
    return {"type": "token", "seq": event["seq"], "index": event["index"], "tokens": len(event["token_ids"]),
            "chars": len(event["text"]) + len(event.get("reasoning", ""))}


async def retry_dead_letter(client: Client, entry_hex: str) -> str:
    """Submit a dead letter's job again (a new id, the client's enqueue path) and drop the dead letter; its new
    id. :class:`BadRequest` when no such dead letter is listed or its job record is gone (nothing to re-run)."""
    keys: Keys = client.keys
    for raw in await client.redis.lrange(keys.dead_letters(), 0, -1):  # type: ignore[misc]
        letter = json.loads(raw)
        if letter.get("hex") != entry_hex:
            continue
        rid = bytes.fromhex(entry_hex).decode(errors="replace")
        record = await client.redis.get(keys.job(rid)) if rid.isprintable() else None
        if record is None:
            raise BadRequest(f"dead letter {rid!r}: its job record is gone, so there is nothing to submit again")
        payload = read_job(record, _READ_LIMIT).payload
        if not isinstance(payload, dict):
            raise BadRequest(f"dead letter {rid!r}: its job record holds no request")
        request = GenerateRequest.model_validate({k: v for k, v in payload.items() if k != "id"})
        new_id = await client.submit(request)
        await client.redis.lrem(keys.dead_letters(), 1, raw)  # type: ignore[misc]
        return new_id
    raise BadRequest("no such dead letter")
