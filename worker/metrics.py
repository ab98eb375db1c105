"""A worker's metrics: one Prometheus registry that feeds the ``/metrics`` endpoint (``MLXQ_METRICS_PORT``),
the stats line the worker logs when it stops, and the benchmark (which scrapes the endpoint).

Names and labels follow vLLM's (``vllm:num_requests_running{model_name=...}``) under an ``mlxq:`` prefix.
The counters the worker's parts keep anyway (engine steps, Redis writes, fenced runs, reaped jobs...) are read
at scrape time by a collector, so nothing is counted twice; what is only known when a job ends (its outcome
and timings) is observed then, once per job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxq.api.protocol.claim import Affinity
from mlxq.api.schema import DoneEvent, ErrorEvent

if TYPE_CHECKING:
    from .host import WorkerHost
    from .jobs.run import Run, Wire

__all__ = ["Metrics"]

log = logging.getLogger(__name__)

_MODEL = ["model_name"]
_TENANT = ["model_name", "tenant"]
# Latency buckets (seconds): from a tiny model's milliseconds to a big model's minute-long jobs.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class _JobMetrics:
    """One (model, tenant)'s children of the metrics a job's end observes (``Metrics.ended``)."""

    prompt_tokens: Any
    e2e: Any
    queue_time: Any
    ttft: Any
    tpot: Any
    tenant_generated: Any
    tenant_prompt: Any
    tenant_queue_time: Any
    outcomes: dict[tuple[str, str], tuple[Any, ...]] = field(default_factory=dict)  # (type, reason) -> counters


@dataclass
class Metrics:
    """The registry of one worker process."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        r = self.registry
        self.success = Counter("mlxq:request_success", "Jobs this worker ended with done, by finish reason.",
                               [*_MODEL, "finished_reason"], registry=r)
        self.failure = Counter("mlxq:request_failure", "Jobs this worker ended with an error, by error code.",
                               [*_MODEL, "code"], registry=r)
        self.prompt_tokens = Counter("mlxq:prompt_tokens", "Prompt tokens of the jobs this worker ran.", _MODEL,
                                     registry=r)
        self.queue_time = Histogram("mlxq:request_queue_time_seconds", "Enqueue to admission into the batch.",
                                    _MODEL, buckets=_LATENCY, registry=r)
        self.ttft = Histogram("mlxq:time_to_first_token_seconds", "Enqueue to the first token.", _MODEL,
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("mlxq:time_per_output_token_seconds", "Decode time per token after the first.",
                              _MODEL, buckets=_STEP, registry=r)
        self.e2e = Histogram("mlxq:e2e_request_latency_seconds", "Enqueue to the terminal event.", _MODEL,
                             buckets=_LATENCY, registry=r)
        self.step = Histogram("mlxq:engine_step_seconds", "One engine step (a decode step and a prefill chunk).",
                              _MODEL, buckets=_STEP, registry=r)
        self.tenant_ended = Counter("mlxq:tenant_requests", "Jobs this worker ended, by tenant.",
                                    [*_TENANT, "outcome"], registry=r)
        self.tenant_generated = Counter("mlxq:tenant_generation_tokens", "Tokens generated for the tenant's jobs "
                                        "on this worker.", _TENANT, registry=r)
        self.tenant_prompt = Counter("mlxq:tenant_prompt_tokens", "Prompt tokens of the tenant's jobs on this "
                                     "worker.", _TENANT, registry=r)
        self.tenant_queue_time = Histogram("mlxq:tenant_queue_time_seconds", "Enqueue to admission into the "
                                           "batch, by tenant.", _TENANT, buckets=_LATENCY, registry=r)
        self.redis_write = Histogram("mlxq:redis_write_seconds", "One EMIT call (every job's events of a step).",
                                     buckets=_STEP, registry=r)
        self._server: Any = None
        self._jobs: dict[tuple[str, str], _JobMetrics] = {}  # (model, tenant) -> its children (ended())

    def watch(self, host: WorkerHost) -> None:
        """Read ``host``'s counters and gauges at every scrape."""
        self.registry.register(_HostCollector(host))

    def ended(self, run: Run, end: Wire) -> None:
        """A job this worker ran ended with ``end`` (its terminal event): its outcome and timings."""
        m = self._job_metrics(run.model, run.tenant)
        if isinstance(end, ErrorEvent):
            outcome = ("error", end.code.value)
        elif isinstance(end, DoneEvent):
            outcome = ("done", end.finish_reason.value)
        else:
            outcome = (end.type, "")
        counters = m.outcomes.get(outcome)
        if counters is None:
            counters = m.outcomes[outcome] = self._outcome_counters(run.model, run.tenant, *outcome)
        for counter in counters:
            counter.inc()
        m.prompt_tokens.inc(run.prompt_tokens)
        m.tenant_generated.inc(run.completion_tokens)
        m.tenant_prompt.inc(run.prompt_tokens)
        now, enqueued = time.time(), run.enqueue_ms / 1000
        if run.enqueue_ms and run.admitted_at is not None:
            m.tenant_queue_time.observe(max(0.0, run.admitted_at - enqueued))
        if run.enqueue_ms:
            m.e2e.observe(max(0.0, now - enqueued))
            if run.admitted_at is not None:
                m.queue_time.observe(max(0.0, run.admitted_at - enqueued))
            if run.first_token_at is not None:
                m.ttft.observe(max(0.0, run.first_token_at - enqueued))
        if run.first_token_at is not None and run.completion_tokens > 1:
            m.tpot.observe((now - run.first_token_at) / (run.completion_tokens - 1))

    def _job_metrics(self, model: str, tenant: str) -> _JobMetrics:
        """The per-job metrics' children for ``model`` and ``tenant``, looked up once: ``labels()`` checks and
        locks at every call (a few µs each, ten a job end, on the event loop)."""
        m = self._jobs.get((model, tenant))
        if m is None:
            m = self._jobs[model, tenant] = _JobMetrics(
                prompt_tokens=self.prompt_tokens.labels(model), e2e=self.e2e.labels(model),
                queue_time=self.queue_time.labels(model), ttft=self.ttft.labels(model), tpot=self.tpot.labels(model),
                tenant_generated=self.tenant_generated.labels(model, tenant),
                tenant_prompt=self.tenant_prompt.labels(model, tenant),
                tenant_queue_time=self.tenant_queue_time.labels(model, tenant))
        return m

    def _outcome_counters(self, model: str, tenant: str, kind: str, reason: str) -> tuple[Any, ...]:
        """The counters one job end of ``kind`` (its event's type) and ``reason`` (finish reason or error code)
        adds one to."""
        ended = self.tenant_ended.labels(model, tenant, kind)
        if kind == "error":
            return (self.failure.labels(model, reason), ended)
        if kind == "done":
            return (self.success.labels(model, reason), ended)
        return (ended,)

    def step_timer(self, model: str) -> Callable[[float], None]:
        """What an engine calls (on its MLX thread) with each step's duration."""
        return self.step.labels(model).observe

    def serve(self, port: int, addr: str) -> str:
        """Serve ``/metrics`` on ``addr:port`` (a thread of prometheus_client's); the URL."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return f"http://{addr}:{port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def totals(self) -> dict[str, float]:
        """Every counter, summed over its labels (the stats line): ``{"engine_steps": 1234.0, ...}``."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type != "counter":
                continue
            name = family.name.removeprefix("mlxq:")
            out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return out

    def stats_line(self) -> str:
        """The counters, and the memory gauges an operator reads beside them."""
        values = self.totals()
        for family in self.registry.collect():
            name = family.name.removeprefix("mlxq:")
            if family.type == "gauge" and name in _STATS_GAUGES:
                values[name] = sum(s.value for s in family.samples)
        return " ".join(f"{k}={v:g}" for k, v in values.items())


class _HostCollector(Collector):
    """The counters and gauges a worker's parts keep, read when scraped (from prometheus_client's thread:
    each value is one int read whole, so no lock is needed)."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        h = self.host
        p = h.runs.stats
        for _, service in _services(h):  # the disk tier's counts as of this scrape, read once for all its metrics
            if service.engine is not None:
                service.engine.counters()
        yield _counter("mlxq:engine_steps", "Engine steps.", {n: _engine(s, "steps") for n, s in _services(h)})
        yield _counter("mlxq:engine_failures", "Engine steps that failed (their jobs got engine_error).",
                       {n: _engine(s, "failures") for n, s in _services(h)})
        yield _counter("mlxq:generation_tokens", "Tokens generated.", dict(p.tokens_by_model))
        yield from _engine_counters(h)
        yield _plain("mlxq:redis_writes", "EMIT calls carrying engine steps' events.", p.writes)
        yield _plain("mlxq:redis_other_writes", "EMIT calls for single jobs (cancels, resets, rejections).",
                     p.other_writes)
        yield _plain("mlxq:events", "Events written.", p.events)
        yield _plain("mlxq:lease_losses", "Runs fenced: their lease was gone (taken over, reaped, or Redis lost).",
                     p.lease_losses)
        yield _plain("mlxq:resets", "Jobs this worker handed back to their queue (shutdown).", p.handed_back)
        yield _plain("mlxq:reaped", "Jobs of lost workers this worker re-queued or ended.", h.reaper.reaped)
        yield _plain("mlxq:expired", "Queued jobs this worker ended at their expiry.", h.reaper.expired)
        yield _plain("mlxq:dead_lettered", "Queue entries moved to the dead-letter list.", h.dead_lettered)
        yield _plain("mlxq:data_lost", "Jobs ended with data_lost (Redis lost them while they ran).", p.data_lost)
        yield _plain("mlxq:model_loads", "Models loaded on demand (MLXQ_LOADABLE_MODELS).", h.ondemand.loads)
        yield _plain("mlxq:model_unloads", "Models unloaded (idle, or to make room).", h.ondemand.unloads)
        yield _plain("mlxq:model_load_failures", "Loads on demand that failed (missing or corrupt files).",
                     h.ondemand.load_failures)
        running = GaugeMetricFamily("mlxq:num_requests_running", "Sequences in the batch.", labels=_MODEL)
        waiting = GaugeMetricFamily("mlxq:num_requests_waiting", "Jobs claimed, not yet in the batch.",
                                    labels=_MODEL)
        queued = GaugeMetricFamily("mlxq:queue_depth", "Jobs waiting in the model's queue in Redis (all workers').",
                                   labels=_MODEL)
        dead = GaugeMetricFamily("mlxq:engine_dead", "1 if the model's engine died on this worker.", labels=_MODEL)
        loaded = GaugeMetricFamily("mlxq:model_loaded", "1 while the model is in memory on this worker.",
                                   labels=_MODEL)
        for name, service in _services(h):
            status = service.status(0.0)
            running.add_metric([name], status.running)
            waiting.add_metric([name], status.waiting)
            queued.add_metric([name], h.queue_depths.get(name, 0))
            dead.add_metric([name], 1 if status.state.value == "dead" else 0)
            loaded.add_metric([name], int(service.engine is not None))
        yield from (running, waiting, queued, dead, loaded)
        yield from _tenant_gauges(h)
        yield from _affinity(h)
        yield from _engine_gauges(h)
        yield GaugeMetricFamily("mlxq:worker_draining", "1 while the worker shuts down.", value=int(h.draining))


_ENGINE_COUNTERS = (  # name, EngineStats field(s) summed, help
    ("mlxq:prefix_cache_queries", ("prefix_hits", "prefix_misses"), "Requests that looked for a cached prefix."),
    ("mlxq:prefix_cache_hits", ("prefix_hits",), "Requests that reused a cached prefix."),
    ("mlxq:prefix_cache_tokens_saved", ("prefix_tokens_saved",), "Prompt tokens not prefilled thanks to a hit."),
    ("mlxq:prefix_disk_hits", ("prefix_disk_hits",), "Cached prefixes read from disk for a request (after a restart)."),
    ("mlxq:prefix_disk_misses", ("prefix_disk_misses",), "Requests whose prefix neither memory nor disk held."),
    ("mlxq:prefix_disk_errors", ("prefix_disk_errors",),
     "Prefixes on disk that could not be read (corrupt): their requests prefilled cold."),
    ("mlxq:prefix_disk_writes", ("prefix_disk_writes",), "Cached prefixes written to disk."),
    ("mlxq:prefix_disk_dropped", ("prefix_disk_dropped",),
     "Cached prefixes not written to disk: its writer was too far behind (they stay in memory only)."),
    ("mlxq:num_preemptions", ("preemptions",), "Sequences taken out of the batch for higher-priority ones."),
    ("mlxq:preemption_resumes", ("resumes",), "Preempted sequences resumed from their own KV cache."),
    ("mlxq:preemption_recomputes", ("recomputes",), "Preempted sequences resumed by prefilling again."),
    ("mlxq:priority_started_at_once", ("started_at_once",),
     "Requests that outranked a running one: prefilled alone, first token before the next decode step."),
    ("mlxq:admission_wait_ms", ("admission_wait_ms",),
     "Milliseconds steps were held for claimed requests on their way (an idle engine's first, one beside bulk rows)."),
    ("mlxq:requests_too_large", ("rejected_too_large",), "Requests that could never fit (context or headroom)."),
    ("mlxq:spec_decode_num_draft_tokens", ("spec_drafted",), "Tokens proposed to sequences (speculative decoding)."),
    ("mlxq:spec_decode_num_accepted_tokens", ("spec_accepted",), "Proposed tokens the model agreed with."),
    ("mlxq:spec_decode_num_steps", ("spec_steps",), "Steps that scored proposals."),
)
_STATS_GAUGES = ("kv_cache_peak_bytes", "prefix_cache_bytes", "prefix_cache_entries", "prefix_disk_bytes")
_ENGINE_GAUGES = (
    ("mlxq:kv_cache_usage_bytes", "kv_bytes", "KV-cache bytes in use (the batch's, and preempted ones held)."),
    ("mlxq:kv_cache_peak_bytes", "kv_bytes_peak", "Most KV-cache bytes in use since the start."),
    ("mlxq:kv_cache_headroom_bytes", "kv_headroom_bytes", "KV-cache bytes the batch may hold."),
    ("mlxq:prefix_cache_bytes", "prefix_cache_bytes", "Bytes of cached prompt prefixes."),
    ("mlxq:prefix_cache_entries", "prefix_cache_entries", "Cached prompt prefixes."),
    ("mlxq:prefix_disk_bytes", "prefix_disk_bytes", "Bytes of cached prompt prefixes on disk."),
    ("mlxq:prefix_disk_entries", "prefix_disk_entries", "Cached prompt prefixes on disk."),
    ("mlxq:spec_decode_k", "spec_k", "Tokens proposed per sequence at the last step (0: plain decoding)."),
)


def _tenant_gauges(host: WorkerHost) -> Iterator[Metric]:
    """Each tenant's queued jobs per served model and running jobs fleet-wide, as Redis held them at the last
    heartbeat (the same numbers on every worker: aggregate with max, not sum)."""
    queued = GaugeMetricFamily("mlxq:tenant_queue_depth", "Jobs of the tenant waiting in the model's queue "
                               "(all workers').", labels=_TENANT)
    for (model, tenant), n in sorted(host.tenant_depths.items()):
        queued.add_metric([model, tenant], n)
    running = GaugeMetricFamily("mlxq:tenant_requests_running", "Jobs of the tenant running, fleet-wide (its "
                                "max-running holds this).", labels=["tenant"])
    for tenant, n in sorted(host.tenants_running.items()):
        running.add_metric([tenant], n)
    yield from (queued, running)


def _affinity(host: WorkerHost) -> Iterator[Metric]:
    """Prefix affinity (worker/affinity.py): how CLAIM placed this worker's jobs that carry an affinity key, and
    the keys it advertises."""
    placed = CounterMetricFamily("mlxq:affinity_placements", "Jobs with an affinity key this worker started: "
                                 "outcome holder (its prefix cache held the key), elsewhere (after waiting "
                                 "MLXQ_AFFINITY_WAIT_MS for the live worker holding it), none (no live worker "
                                 "held it).", labels=[*_MODEL, "outcome"])
    keys = GaugeMetricFamily("mlxq:affinity_keys", "Affinity keys this worker advertises (its prefix caches hold "
                             "their prompts' starts).", labels=_MODEL)
    for name in host.services:
        p, held = host.affinity.placements.get(name), host.affinity.holdings.get(name)
        for outcome in Affinity:
            placed.add_metric([name, outcome.value], p.counts[outcome] if p is not None else 0)
        keys.add_metric([name], len(held) if held is not None else 0)
    yield from (placed, keys)


def _engine_counters(host: WorkerHost) -> Iterator[Metric]:
    services = _services(host)
    for name, fields, doc in _ENGINE_COUNTERS:
        yield _counter(name, doc, {n: sum(_engine(s, f) for f in fields) for n, s in services})


def _engine_gauges(host: WorkerHost) -> Iterator[Metric]:
    services = _services(host)
    for name, field_name, doc in _ENGINE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=_MODEL)
        for n, s in services:
            family.add_metric([n], _engine(s, field_name))
        yield family


def _services(host: WorkerHost) -> list[tuple[str, Any]]:
    return list(host.services.items())


def _engine(service: Any, name: str) -> int:
    return int(getattr(service.engine.stats, name)) if service.engine is not None else 0


def _counter(name: str, doc: str, by_model: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=_MODEL)
    for model, value in by_model.items():
        family.add_metric([model], value)
    return family


def _plain(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
