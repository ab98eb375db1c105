"""``mlxq status``: the deployment at a glance, read from Redis (so it works from any host).

For every model with a queue or a live worker: jobs waiting, the age of the oldest, and what its live workers
do now, with its bulk band apart (BULK: its jobs queued / in engines); each tenant with a policy entry or jobs
queued or running (its policy, and its live use); then each live worker (host, pid, models, capacity, running
and waiting sequences, tokens per second over the last minute, prefix-cache hits in memory and on disk, uptime,
version). As text for a terminal, or JSON for scripts.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.exceptions import RedisError

from .client import Client
from .follow import JobView
from .protocol.keys import band_model, model_band
from .protocol.notify import eviction_risk, report
from .registry import ModelInfo, QueueInfo, models_of
from .schema import ModelStatus, WorkerStatus
from .tenants import TenantUse

__all__ = ["Report", "claimed", "collect", "live", "render", "render_job", "tenant_table"]


@dataclass(frozen=True, slots=True)
class Report:
    """What ``mlxq status`` shows."""

    where: str  # the Redis address (no password)
    prefix: str
    at: float
    queues: dict[str, QueueInfo]
    models: dict[str, ModelInfo]
    workers: list[WorkerStatus]
    tenants: list[TenantUse]
    eviction: str | None = None  # why Redis could evict kept results (notify.eviction_risk), or None
    webhooks: dict[str, Any] = field(default_factory=dict)  # deliveries: counters, waiting, newest failures

    def to_json(self) -> dict[str, Any]:
        return {
            "redis": self.where, "prefix": self.prefix, "at": self.at, "eviction_risk": self.eviction,
            "webhooks": self.webhooks,
            "models": [_model_json(name, self.queues.get(name), self.models.get(name),
                                   self.queues.get(band_model(name, True))) for name in self.names()],
            "tenants": [t.to_json() for t in self.tenants],
            "workers": [w.model_dump(mode="json") for w in self.workers],
        }

    def names(self) -> list[str]:
        """The models it shows: those queued (in either band) or served."""
        return sorted({model_band(name)[0] for name in self.queues} | set(self.models))


async def collect(client: Client) -> Report:
    """Read the queues and the live workers' health records, their jobs claimed as of now (as the tenants'
    are counted), and the tenants."""
    workers = live(await client.workers(), await claimed(client))
    queues = {q.model: q for q in await client.queues()}
    tenants = await client.tenants([q for q in queues.values()])
    eviction, hooks = None, {}
    with contextlib.suppress(RedisError):  # INFO refused (ACL): nothing to say
        eviction = await eviction_risk(client.redis)
    with contextlib.suppress(RedisError):
        hooks = await report(client.redis, client.keys)
    return Report(client.where, client.keys.prefix, time.time(), queues, models_of(workers), workers, tenants,
                  eviction, hooks)


async def claimed(client: Client) -> dict[tuple[str, str], int]:
    """Jobs inside some worker's engine now, by (worker id, model): the running list and leases the job
    transitions keep, in the same calls that count each tenant's jobs running."""
    keys = client.keys
    running = await client.redis.hgetall(keys.running())  # type: ignore[misc]
    async with client.redis.pipeline(transaction=False) as pipe:
        for rid in running:
            pipe.get(keys.lease(rid.decode()))
        leases = await pipe.execute()
    counts: dict[tuple[str, str], int] = {}
    for value, lease in zip(running.values(), leases):
        if lease:  # "<worker id>:<try>"; a job whose lease lapsed is no worker's until the reaper hands it back
            at = (lease.decode().rpartition(":")[0], keys.queue_of(value.decode().partition(" ")[2])[0])
            counts[at] = counts.get(at, 0) + 1
    return counts


def live(workers: list[WorkerStatus], claimed: dict[tuple[str, str], int]) -> list[WorkerStatus]:
    """The health records with each model's running and waiting as of now: its jobs ``claimed`` (a record is
    up to a heartbeat old, the tenants' counts are not), of which waiting what the record says, at most; of
    them ``bulk`` its bulk band's (claimed from the model's bulk queues)."""
    out = []
    for w in workers:
        models = []
        for m in w.models:
            bulk = claimed.get((w.id, band_model(m.name, True)), 0)
            n = claimed.get((w.id, m.name), 0) + bulk
            models.append(m.model_copy(update={"running": n - min(m.waiting, n), "waiting": min(m.waiting, n),
                                               "bulk": bulk}))
        out.append(w.model_copy(update={"models": models}))
    return out


def render(report: Report) -> str:
    """The report as text tables."""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.at))
    lines = [f"mlxq status: {report.where}, prefix {report.prefix!r}, {at}", ""]
    if report.eviction:
        lines += [f"WARNING: {report.eviction}", ""]
    lines += _webhook_lines(report.webhooks)
    names = report.names()
    if not names:
        lines.append("no queued jobs and no live workers")
        return "\n".join(lines)
    rows = [["MODEL", "QUEUED", "OLDEST", "WORKERS", "CAPACITY", "RUNNING", "WAITING", "BULK", "TOK/S", "IMAGES"]]
    for name in names:
        q, m, b = report.queues.get(name), report.models.get(name), report.queues.get(band_model(name, True))
        bulk = f"{b.depth if b else 0}/{m.bulk if m else 0}"  # the bulk band: queued / in engines
        depth = str(q.depth) if q else "0"
        oldest = _age(q.oldest_s) if q and q.oldest_s is not None else "-"
        if m is not None and m.workers == 0 and m.loadable:
            rows.append([name, depth, oldest, "0", "-", "-", "-", bulk, "-", f"loadable on {m.loadable}"])
        elif m is None or m.workers == 0:
            note = "dead on every worker" if m is not None and m.dead_on else "no live worker"
            rows.append([name, depth, oldest, "0", "-", "-", "-", bulk, "-", note])
        else:
            rows.append([name, depth, oldest, str(m.workers), str(m.capacity), str(m.running), str(m.waiting),
                         bulk, f"{m.tokens_per_s:.1f}", "yes" if m.accepts_images else "no"])
    lines += _table(rows)
    if len(report.tenants) > 1 or any(t.named for t in report.tenants):  # one default tenant: nothing to say
        lines += ["", *tenant_table(report.tenants)]
    if report.workers:
        lines += ["", *_table(_worker_rows(report))]
    return "\n".join(lines)


def _webhook_lines(hooks: dict[str, Any]) -> list[str]:
    """One line of webhook deliveries (if any were made or wait), the endpoints a 410 disabled, and the newest
    failures."""
    counts = hooks.get("counts") or {}
    disabled = hooks.get("disabled") or []
    if not counts and not hooks.get("waiting") and not disabled:
        return []
    line = (f"webhooks: {counts.get('delivered', 0)} delivered, {counts.get('retried', 0)} retried, "
            f"{counts.get('failed', 0)} failed, {counts.get('disabled', 0)} endpoint 410s; "
            f"{hooks.get('waiting', 0)} waiting")
    gone = [f"  disabled: {d['url']} answered 410 Gone at {_stamp(d['at_ms'])}: no gateway delivers to it"
            for d in disabled]
    failed = [f"  failed: {f['type']} {f['id']} ({f['event']}) to {f['url']}{_after(f)}: {f['error']}"
              for f in hooks.get("failures", [])[:3]]
    return [line, *gone, *failed, ""]


def _after(failure: dict[str, Any]) -> str:
    attempts = failure.get("attempts")  # none in a failure a gateway of an earlier release recorded
    return f" after {attempts} attempts" if attempts else ""


def _stamp(at_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at_ms / 1000))


def render_job(view: JobView) -> tuple[str, dict[str, Any]]:
    """``mlxq job``: one job as a text block, and as JSON."""
    data: dict[str, Any] = {"id": view.id, "status": view.status, "text": view.text}
    lines = [f"job {view.id}: {view.status}"]
    if view.done is not None:
        d = view.done
        t = d.timings
        data.update(finish_reason=d.finish_reason.value, usage=d.usage.model_dump(), timings=t.model_dump(),
                    tenant=d.tenant, tool_calls=[c.model_dump() for c in d.tool_calls or []])
        lines[0] += f" ({d.finish_reason.value})"
        lines.append(f"tenant:   {d.tenant or 'default'}")
        lines.append(f"usage:    {d.usage.prompt_tokens} prompt + {d.usage.completion_tokens} completion tokens")
        speed = f", {t.tokens_per_s:.1f} tok/s" if t.tokens_per_s else ""
        first = f", first token {t.ttft_ms:.0f} ms" if t.ttft_ms is not None else ""
        lines.append(f"timings:  queued {t.queue_ms:.0f} ms{first}, total {t.total_ms:.0f} ms{speed}")
        for c in d.tool_calls or []:
            lines.append(f"tool call: {c.function.name}({c.function.arguments})")
    if view.error is not None:
        e = view.error
        data["error"] = {"code": e.code.value, "message": e.message, "retryable": e.retryable}
        lines.append(f"error:    {e.code.value}: {e.message}" + (" (retryable)" if e.retryable else ""))
    if view.kept is not None:
        data["finished_at_ms"] = view.kept.finish_ms
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view.kept.finish_ms / 1000))
        lines.append(f"ended:    {ended} (its kept result)")
    if view.reasoning:
        data["reasoning"] = view.reasoning
        lines += ["reasoning:", view.reasoning]
    if view.text or view.status in ("done", "running"):
        lines += ["text:", view.text]
    return "\n".join(lines), data


def tenant_table(tenants: list[TenantUse]) -> list[str]:
    """Each tenant's policy (``-``: no cap; ``*``: the default policy, no entry) and live use, as a table."""
    rows = [["TENANT", "WEIGHT", "MAX-RUN", "MAX-QUEUED", "TOK/MIN-CAP", "QUEUED", "RUNNING", "TOK/MIN", "SHARE"]]
    for t in tenants:
        p = t.policy
        cap = lambda n: str(n) if n else "-"  # noqa: E731
        rows.append([t.name if t.named else f"{t.name}*", f"{p.weight:g}", cap(p.max_running), cap(p.max_queued),
                     cap(p.tokens_per_minute), str(t.queued), str(t.running), f"{t.tokens_per_minute:.0f}",
                     f"{t.share:.0%}"])
    return _table(rows)


def _worker_rows(report: Report) -> list[list[str]]:
    rows = [["WORKER", "HOST", "PID", "MODEL", "STATE", "CAP", "RUN", "WAIT", "TOK/S", "PREFIX HITS", "AFFINITY",
             "SPECULATION", "UPTIME", "VERSION"]]
    for w in report.workers:
        for i, m in enumerate(w.models):
            state = "draining" if w.draining and m.state.value == "serving" else m.state.value
            head = [w.id, w.host, str(w.pid)] if i == 0 else ["", "", ""]
            tail = [_age(report.at - w.started_at), w.version] if i == 0 else ["", ""]
            rows.append([*head, m.name, state, str(m.capacity), str(m.running), str(m.waiting),
                         f"{m.tokens_per_s:.1f}", _prefix(m), _affinity(m), _speculation(m), *tail])
    return rows


def _prefix(m: ModelStatus) -> str:
    """Its prefix cache: the share of lookups that hit, and its tier on disk (``40% of 10; disk 3 hits, 12 held``)."""
    looks = m.prefix_hits + m.prefix_misses
    text = f"{m.prefix_hits / looks:.0%} of {looks}" if looks else "-"
    if m.prefix_disk_hits or m.prefix_disk_entries or m.prefix_disk_writes:
        text += f"; disk {m.prefix_disk_hits} hits, {m.prefix_disk_entries} held"
        if m.prefix_disk_errors:
            text += f", {m.prefix_disk_errors} unreadable"
    return text


def _affinity(m: ModelStatus) -> str:
    """How CLAIM placed its jobs with an affinity key (held here / here after the wait / no holder), and the
    keys it advertises."""
    placed = m.affinity_holder + m.affinity_elsewhere + m.affinity_none
    if not placed and not m.affinity_keys:
        return "-"
    return f"{m.affinity_holder}/{m.affinity_elsewhere}/{m.affinity_none} {m.affinity_keys}k"


def _speculation(m: ModelStatus) -> str:
    """How a model speculates: its proposer, the share of proposals taken, the tokens proposed at its last step."""
    if not m.speculation:
        return "-"
    taken = f" {m.accepted / m.drafted:.0%} taken" if m.drafted else ""
    return f"{m.speculation}{taken} k={m.spec_k}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _model_json(name: str, q: QueueInfo | None, m: ModelInfo | None, bulk: QueueInfo | None) -> dict[str, Any]:
    served = asdict(m) if m is not None else {"workers": 0}
    served.pop("name", None)
    return {"name": name, "queued": q.depth if q else 0, "oldest_s": q.oldest_s if q else None,
            "bulk_queued": bulk.depth if bulk else 0, **served}
