"""A producer's two scripts: ENQUEUE (``lua/enqueue.lua``, sent in batches by :class:`~.enqueuer.Enqueuer`) and
CANCEL (``lua/cancel.lua``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .keys import CANCEL_TTL_S, Keys, band_model, deadline_member
from .scripts import Layout, load

__all__ = ["CANCEL", "ENQUEUE", "Enqueue", "cancel"]

ENQUEUE = load("enqueue", Layout(
    keys=("job_key", "result_key", "queue_key", "deadlines_key", "backlog_key", "policy_key"),
    args=("rid", "job", "ttl_ms", "wake_channel", "score", "max_queued", "expiry_ms", "deadline_member", "tenant",
          "prefix", "model"),
))
CANCEL = load("cancel", Layout(keys=("job_key", "log_key", "cancel_key", "result_key"), args=("rid", "cancel_channel")),
              {"CANCEL_TTL_S": CANCEL_TTL_S})


@dataclass(frozen=True, slots=True)
class Enqueue:
    """One job's ENQUEUE: ``job`` its record (``jobrecord.job_record``), ``score`` its place in its queue
    (``keys.queue_score``), ``max_queued`` the model's cap over all tenants (0: none), ``expiry_ms`` when it
    lapses if still queued (0: never), ``ttl_ms`` how long its record, queue and backlog live."""

    rid: str
    job: bytes
    model: str
    tenant: str
    score: int
    max_queued: int
    expiry_ms: int
    ttl_ms: int
    bulk: bool = False  # the bulk band: the model's bulk queues, backlog and cap (keys.band_model)

    def call(self, keys: Keys) -> tuple[list[Any], list[Any]]:
        """ENQUEUE's KEYS and ARGV for this job. Replies: 1 queued, 0 the id is taken, -1 the model's queue is
        full, -2 the tenant's ``max_queued`` is reached."""
        band = band_model(self.model, self.bulk)
        queue = keys.queue(band, self.tenant)
        named = {"job_key": keys.job(self.rid), "result_key": keys.result(self.rid), "queue_key": queue,
                 "deadlines_key": keys.deadlines(), "backlog_key": keys.backlog(band),
                 "policy_key": keys.tenant(self.tenant)}
        args = {"rid": self.rid, "job": self.job, "ttl_ms": self.ttl_ms, "wake_channel": keys.wake_channel(self.model),
                "score": self.score, "max_queued": self.max_queued, "expiry_ms": self.expiry_ms,
                "deadline_member": deadline_member(self.rid, queue), "tenant": self.tenant, "prefix": keys.prefix,
                "model": band}
        return ENQUEUE.layout.pack(named, args)


async def cancel(redis: Redis, keys: Keys, rid: str) -> int:
    """Ask for a job to stop: 1 requested, 2 it ended already (nothing to cancel), 0 no such job."""
    named = {"job_key": keys.job(rid), "log_key": keys.log(rid), "cancel_key": keys.cancel(rid),
             "result_key": keys.result(rid)}
    outcome: int = await CANCEL.run(redis, named, {"rid": rid, "cancel_channel": keys.cancel_channel()})
    return outcome
