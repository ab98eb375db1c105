"""Every Redis name mlxq uses, under one configurable prefix.

Per-job keys share the ``{rid}`` hash tag, so one job's keys live in one Redis Cluster slot.
The event channel name is public API: ``SUBSCRIBE <prefix>:{<rid>}:events`` sees a job's events.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import DEFAULT_TENANT, PRIORITY_MIN
from ..schema.requests import BULK_MARK

__all__ = ["BULK_MARK", "QUEUE_NAMES", "Keys", "band_model", "model_band"]

# TTLs, in seconds.
LIVE_TTL_S = 600  # replay log while a job runs (refreshed on every write)
DONE_TTL_S = 300  # replay log after its terminal event
CANCEL_TTL_S = 3600
REGISTRY_TTL_S = 86_400  # the set of workers, refreshed by every heartbeat
KEEP_RESULT_S = 3600  # an ended job's kept result (MLXQ_KEEP_RESULT; a request's keep_result_s overrides it)
WEBHOOKS_KEPT = 100_000  # webhook events the stream holds (MAXLEN ~): delivered ones are trimmed away in time

# The queue-name format, written once: the default tenant's queue of a model is ``<prefix>:<QUEUE_PART>:<model>``
# (arq's queue), another tenant's ``<prefix>:<TENANT_QUEUE_PART>:<tenant>:<model>``. :class:`Keys` builds and
# parses names from these parts in Python, ``lua/queues.lua`` in the scripts (every script's prologue declares
# them: api.protocol.scripts). The bulk band (``GenerateRequest.bulk``) queues under the model's name with
# ``BULK_MARK`` appended (:func:`band_model`): its own queues, backlog, fair-share account and history, which CLAIM
# gives way to the model's interactive jobs (lua/bulk.lua). No model's name ends so (GenerateRequest refuses it).
QUEUE_NAMES: dict[str, str] = {"QUEUE_PART": "queue", "TENANT_QUEUE_PART": "tqueue", "DEFAULT_TENANT": DEFAULT_TENANT,
                               "BULK_MARK": BULK_MARK}


def band_model(model: str, bulk: bool) -> str:
    """The name ``model``'s jobs of a band queue under (its queues, backlog and share account): the model's own
    for interactive jobs, with :data:`BULK_MARK` appended for bulk ones."""
    return model + BULK_MARK if bulk else model


def model_band(name: str) -> tuple[str, bool]:
    """The model and whether it is the bulk band, of a name :func:`band_model` made (``Keys.queue_of``'s model)."""
    if name.endswith(BULK_MARK) and len(name) > len(BULK_MARK):
        return name[:-len(BULK_MARK)], True
    return name, False


@dataclass(frozen=True, slots=True)
class Keys:
    """Names of queues, channels and keys for one deployment (``prefix`` separates deployments)."""

    prefix: str = "mlxq"

    def queue(self, model: str, tenant: str = DEFAULT_TENANT, bulk: bool = False) -> str:
        """The queue (a sorted set) of ``model``'s jobs of ``tenant``: the default tenant's is arq's queue
        (``<prefix>:queue:<model>``), another's ``<prefix>:tqueue:<tenant>:<model>`` (a tenant name holds no
        ``:``, so the name says both). Workers serving ``model`` claim from all of them. ``bulk``: the bulk band's
        queue (:func:`band_model`)."""
        model = band_model(model, bulk)
        if tenant == DEFAULT_TENANT:
            return f"{self.prefix}:{QUEUE_NAMES['QUEUE_PART']}:{model}"
        return f"{self.tenant_queues()}{tenant}:{model}"

    def tenant_queues(self) -> str:
        """What the name of every tenant's queue (but the default tenant's) starts with."""
        return f"{self.prefix}:{QUEUE_NAMES['TENANT_QUEUE_PART']}:"

    def queue_of(self, queue: str) -> tuple[str, str]:
        """The model and tenant a queue name (of :meth:`queue`) belongs to; a bulk queue's model ends with
        :data:`BULK_MARK` (:func:`model_band` splits it)."""
        tq = self.tenant_queues()
        if queue.startswith(tq):
            tenant, _, model = queue[len(tq):].partition(":")
            return model, tenant
        return queue.removeprefix(self.queue("")), DEFAULT_TENANT

    def backlog(self, model: str) -> str:
        """Set of the tenants that may have ``model``'s jobs queued (ENQUEUE and hand-backs add, CLAIM trims)."""
        return f"{self.prefix}:backlog:{model}"

    def affinity_advertisers(self, model: str) -> str:
        """Zset of the workers advertising ``model``'s affinity keys, scored by when their advertisement lapses
        (ms): CLAIM counts an advertiser live until then (api/affinity.py, worker/affinity.py)."""
        return f"{self.prefix}:affholders:{model}"

    def affinity_keys(self, model: str, worker_id: str) -> str:
        """Set of the affinity keys whose prompts ``worker_id``'s prefix cache for ``model`` has warm (with a TTL)."""
        return f"{self.prefix}:affkeys:{model}:{worker_id}"

    def affinity_full(self, model: str) -> str:
        """Zset of the advertising workers whose engines for ``model`` are full (no free slot or KV headroom),
        scored by when that mark lapses (ms): CLAIM does not keep their keys' jobs waiting for them."""
        return f"{self.prefix}:afffull:{model}"

    def share(self, model: str) -> str:
        """Hash of ``model``'s fair-share accounts: ``<tenant>`` its virtual work (tokens ÷ weight),
        ``<tenant>:r`` its jobs running, ``<tenant>:a`` its mean work per job; ``~r`` the model's jobs running,
        ``~floor`` the least virtual work among the backlogged at the last claim (a tenant back from idle starts
        there: no credit for idle time). Dropped by a claim that finds the model idle (nothing queued or
        running)."""
        return f"{self.prefix}:share:{model}"

    def tenant(self, name: str) -> str:
        """Hash of a tenant's policy (``weight``, ``max_running``, ``max_queued``, ``tokens_per_minute``)."""
        return f"{self.prefix}:tenant:{name}"

    def tenants(self) -> str:
        """Set of the tenants with a policy entry."""
        return f"{self.prefix}:tenants"

    def tenants_running(self) -> str:
        """Hash of each tenant's jobs running across the fleet (all models): ``max_running`` holds it."""
        return f"{self.prefix}:tenants:running"

    def tenant_tokens(self, name: str, minute: int) -> str:
        """Tokens (prompt + generated) of a tenant's jobs that ended in one minute (epoch ms // 60000)."""
        return f"{self.prefix}:tpm:{name}:{minute}"

    def events(self, rid: str) -> str:
        """Pub/sub channel carrying a job's events live, as JSON."""
        return f"{self.prefix}:{{{rid}}}:events"

    def log(self, rid: str) -> str:
        """Stream holding every event of a job (entry id ``<seq>-1``), for late or reconnecting readers."""
        return f"{self.prefix}:{{{rid}}}:log"

    def cancel(self, rid: str) -> str:
        """Exists while a cancel of the job is requested."""
        return f"{self.prefix}:{{{rid}}}:cancel"

    def lease(self, rid: str) -> str:
        """Holds the id of the worker running the job, with a short TTL."""
        return f"{self.prefix}:{{{rid}}}:lease"

    def job(self, rid: str) -> str:
        """The job as enqueued (arq's job record: the request inside arq's envelope)."""
        return f"{self.prefix}:{{{rid}}}:job"

    def response(self, rid: str) -> str:
        """The stored Responses-API response of job ``rid`` (api/responses.py): a hash in the job's hash slot."""
        return f"{self.prefix}:{{{rid}}}:response"

    def result(self, rid: str) -> str:
        """An ended job's kept result: arq's result record (its terminal event) with the job's text and reasoning
        (``jobrecord.result_record``), kept its request's ``keep_result_s`` or ``MLXQ_KEEP_RESULT`` seconds."""
        return f"{self.prefix}:{{{rid}}}:result"

    def notify(self, rid: str) -> str:
        """Exists while a job's end is to become a webhook event: ``<family> <object id> <tenant>`` (EMIT adds
        ``<family>.<status>`` to :meth:`webhooks` at the job's end and drops it: api/protocol/notify.py)."""
        return f"{self.prefix}:{{{rid}}}:notify"

    def webhooks(self) -> str:
        """Stream of webhook events to deliver (``type``, ``id``, ``tenant``, ``at_ms``), trimmed (MAXLEN ~);
        the gateways deliver them as one consumer group (api/gateway/webhooks.py)."""
        return f"{self.prefix}:webhooks"

    def webhook_failures(self) -> str:
        """List of the newest webhook deliveries given up (JSON each), bounded, with a TTL."""
        return f"{self.prefix}:webhooks:failed"

    def webhook_counts(self) -> str:
        """Hash of webhook delivery counters (``delivered``, ``failed``, ``disabled``, ``retried``), with a TTL."""
        return f"{self.prefix}:webhooks:counts"

    def webhook_disabled(self) -> str:
        """Hash of the webhook endpoints that answered 410 Gone: url -> JSON ``{at_ms, event}``; no gateway
        delivers to them. An entry counts for ``notify.DISABLED_FOR_S`` after its 410; the hash's TTL is that
        long after its last write."""
        return f"{self.prefix}:webhooks:disabled"

    def tries(self, rid: str) -> str:
        """How many runs of the job started (the lease's token names the run)."""
        return f"{self.prefix}:{{{rid}}}:tries"

    def epoch(self) -> str:
        """A random value the first worker sets: when it changes or vanishes, Redis lost its data."""
        return f"{self.prefix}:epoch"

    def dead_letters(self) -> str:
        """List of queue entries no worker could parse, moved aside (bounded, with a TTL)."""
        return f"{self.prefix}:dead"

    def history(self, model: str, bucket: int) -> str:
        """Hash of a model's jobs that ended in one time bucket (``api.history``), with a TTL."""
        return f"{self.prefix}:hist:{model}:{bucket}"

    def recent(self) -> str:
        """List of the newest ended jobs' summaries, newest first (``api.history``), bounded."""
        return f"{self.prefix}:recent"

    def running(self) -> str:
        """Hash of jobs inside some worker's engine: request id -> arq queue name (the reaper scans it)."""
        return f"{self.prefix}:running"

    def deadlines(self) -> str:
        """Sorted set of queued jobs that expire: member ``<id>@<queue>``, score the expiry (epoch ms)."""
        return f"{self.prefix}:deadlines"

    def workers(self) -> str:
        """Sorted set of workers: member the worker id, score its last heartbeat (epoch ms)."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """A worker's health record (``api.schema.WorkerStatus`` as JSON), with a TTL of a few heartbeats."""
        return f"{self.prefix}:worker:{worker_id}"

    def arq_health(self, host: str, model: str) -> str:
        """arq's health-check key of the workers on ``host`` whose first model is ``model`` (``arq --check``)."""
        return f"{self.prefix}:arq-health:{host}:{model}"

    def loading(self, model: str) -> str:
        """The short lock a worker holds while it loads ``model`` on demand: one loads, the others wait (TTL)."""
        return f"{self.prefix}:loading:{model}"

    def wake_channel(self, model: str) -> str:
        """Pub/sub wake-up for the workers of ``model``: a job was enqueued."""
        return f"{self.prefix}:wake:{model}"

    def cancel_channel(self) -> str:
        """Pub/sub wake-up workers listen on for cancels (payload: request id)."""
        return f"{self.prefix}:cancel"

    # --- files and batches (api/files.py, api/batches.py): each object's keys share its ``{id}`` hash tag ----
    def file(self, file_id: str) -> str:
        """Hash of an uploaded or written file's record (OpenAI's file object, its owner, its chunks' lines)."""
        return f"{self.prefix}:{{{file_id}}}:file"

    def file_chunks(self, file_id: str) -> str:
        """List of a file's bytes in chunks, each ending at a line's end (a line longer than a chunk is one)."""
        return f"{self.prefix}:{{{file_id}}}:chunks"

    def files(self, tenant: str) -> str:
        """Sorted set of a tenant's file ids, scored by creation (ms): the list route's index."""
        return f"{self.prefix}:files:{tenant}"

    def batch(self, batch_id: str) -> str:
        """Hash of a batch's record: OpenAI's batch object's fields, its owner, and the feeder's cursor."""
        return f"{self.prefix}:{{{batch_id}}}:batch"

    def batch_inflight(self, batch_id: str) -> str:
        """Set of a batch's line numbers whose jobs are (or may be) queued or running."""
        return f"{self.prefix}:{{{batch_id}}}:inflight"

    def batch_results(self, batch_id: str) -> str:
        """Hash of a batch's recorded lines: line number -> ``o`` or ``e`` and its output line (set once)."""
        return f"{self.prefix}:{{{batch_id}}}:results"

    def batch_lease(self, batch_id: str) -> str:
        """Holds the id of the feeder driving the batch, with a short TTL (one feeder per batch at a time)."""
        return f"{self.prefix}:{{{batch_id}}}:feeder"

    def batches(self, tenant: str) -> str:
        """Sorted set of a tenant's batch ids, scored by creation (ms): the list route's index."""
        return f"{self.prefix}:batches:{tenant}"

    def batches_open(self) -> str:
        """Set of the batches not yet ended (validating, in progress, finalizing, cancelling): what feeders
        look for."""
        return f"{self.prefix}:batches:open"


def queue_score(enqueue_ms: int, priority: int, aging_ms: int) -> int:
    """A queued job's score: lower runs first. Each priority level is worth ``aging_ms`` of waiting, so a job
    waits at most that long per level behind later jobs of higher priority. Offset so that every score lies
    in the past: a queue entry is due at once whatever its priority (a future score means deferred). Never
    above ``enqueue_ms``: ``mlxq status`` relies on it to find the oldest waiting job without reading them all."""
    return enqueue_ms - (priority - PRIORITY_MIN) * aging_ms


def deadline_member(rid: str, queue: str) -> str:
    """A job's member in ``Keys.deadlines()``; ids never hold ``@``, so the first one splits it."""
    return f"{rid}@{queue}"


def log_entry_id(seq: int) -> str:
    """Stream entry id of event ``seq``: explicit ids make replay-from-seq a plain XRANGE."""
    return f"{seq}-1"

