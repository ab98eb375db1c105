"""The HTTP gateway path: ``mlxq gateway`` (a child process) in front of the queue worker, measured beside the
in-process client on the same worker.

Both paths stream the same prompts greedily: the client as the queue path does (``submit_and_follow``), the
gateway through ``POST /v1/completions`` with ``stream`` and ``stream_options.include_usage``, read by a lean
HTTP client (``http.SseClient``: the client shares the machine's cores, and a heavier one would be measured
more than the gateway). Runs alternate, queue then gateway, each after the same idle pause; TTFT is submit (or
request) -> first text.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from urllib.parse import urlsplit

from mlxq.api.client import Client

from ..process import GatewayProcess
from .http import SseClient
from .paths import _cpu_seconds, _DriveContext, _queue_run, _Trace
from .runs import (
    _PROBE_OFFSET,
    _PROBE_TOKENS,
    _SETTLE_S,
    GatewayProbe,
    GatewayResult,
    GatewayRow,
    PathResult,
    Run,
    _fmt_runs,
    _paired,
    _pct,
    _prompts,
    _ratio,
    _say,
)

__all__ = ["gateway_phase"]

_NEEDS = ("starlette", "uvicorn")


async def gateway_phase(ctx: _DriveContext, client: Client) -> GatewayResult | None:
    """Start a gateway on the worker's deployment and measure it against ``client`` at every N, then TTFT."""
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        _say(f"[{ctx.model}] gateway: skipped ({', '.join(missing)} missing: pip install 'mlxq[bench]')")
        return None
    log_path = ctx.worker.log_path.parent / f"gateway-{ctx.model}.log"
    log_path.unlink(missing_ok=True)
    gateway = GatewayProcess({"MLXQ_REDIS_URL": ctx.url, "MLXQ_PREFIX": ctx.prefix}, log_path).start()
    try:
        await asyncio.to_thread(gateway.wait_ready)
        assert gateway.pid is not None
        return await _drive(ctx, client, gateway.url, gateway.pid)
    finally:
        gateway.stop()


class _Meters:
    """CPU over each path's runs: the bench, worker and Redis processes, and the gateway's own process."""

    def __init__(self, ctx: _DriveContext, gateway_pid: int) -> None:
        self.queue = ctx.meter.fresh()
        self.gateway = ctx.meter.fresh()
        self.gateway_pid = gateway_pid
        self.gateway_s = 0.0


async def _drive(ctx: _DriveContext, client: Client, url: str, gateway_pid: int) -> GatewayResult:
    cfg = ctx.cfg
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    http = SseClient(where.hostname, where.port)
    try:
        await _gateway_run(http, ctx.model, ["warm up"], cfg.warmup_tokens)
        meters = _Meters(ctx, gateway_pid)
        rows = [await _measure_at(ctx, client, http, n, meters) for n in cfg.concurrency]
        probe = await _probe(ctx, client, http)
    finally:
        await http.aclose()
    return GatewayResult(rows, probe, meters.queue.stop(), meters.gateway.stop(), meters.gateway_s)


async def _measure_at(ctx: _DriveContext, client: Client, http: SseClient, n: int, meters: _Meters
                      ) -> GatewayRow:
    """Warm both paths at N, then alternate measured runs: queue (the in-process client), gateway."""
    prompts, cfg = _prompts(n), ctx.cfg
    await _queue_run(client, ctx.model, prompts, cfg.warmup_tokens)
    await _gateway_run(http, ctx.model, prompts, cfg.warmup_tokens)
    queue_runs: list[Run] = []
    gateway_runs: list[Run] = []
    for _ in range(cfg.repeats_for(ctx.model)):
        time.sleep(_SETTLE_S)  # every run after the same idle pause (see paths._frozen)
        with meters.queue.running():
            queue_runs.append(await _queue_run(client, ctx.model, prompts, cfg.max_tokens))
        time.sleep(_SETTLE_S)
        before = _cpu_seconds(meters.gateway_pid)
        with meters.gateway.running():
            gateway_runs.append(await _gateway_run(http, ctx.model, prompts, cfg.max_tokens))
        meters.gateway_s += _cpu_seconds(meters.gateway_pid) - before
    q, g = PathResult.of(queue_runs), PathResult.of(gateway_runs)
    _say(f"[{ctx.model}] N={n:<3} queue {q.tok_s:8.1f} tok/s (runs {_fmt_runs(q)}); "
         f"gateway {g.tok_s:8.1f} tok/s (runs {_fmt_runs(g)})")
    return GatewayRow(n, q, g, _ratio(g.tok_s, q.tok_s), _paired(g.runs_tok_s, q.runs_tok_s),
                      g.ttft_p50_ms - q.ttft_p50_ms, g.ttft_p99_ms - q.ttft_p99_ms)


async def _probe(ctx: _DriveContext, client: Client, http: SseClient) -> GatewayProbe:
    """TTFT of single requests, queue and gateway in turn."""
    queue: list[float] = []
    gateway: list[float] = []
    for k in range(ctx.cfg.ttft_probes):
        prompts = _prompts(1, _PROBE_OFFSET + k)
        queue += (await _queue_run(client, ctx.model, prompts, _PROBE_TOKENS)).ttft_ms
        gateway += (await _gateway_run(http, ctx.model, prompts, _PROBE_TOKENS)).ttft_ms
    q50, q99, g50, g99 = _pct(queue, 50), _pct(queue, 99), _pct(gateway, 50), _pct(gateway, 99)
    probe = GatewayProbe(min(len(queue), len(gateway)), q50, q99, g50, g99, g50 - q50, g99 - q99)
    _say(f"[{ctx.model}] gateway TTFT at N=1: p50 {g50:.1f} ms (queue {q50:.1f}), p99 {g99:.1f} ms (queue {q99:.1f})")
    return probe


async def _gateway_run(http: SseClient, model: str, prompts: list[str], max_tokens: int) -> Run:
    """Every prompt at once through the gateway, streamed; first request -> last stream's end."""
    t0 = time.perf_counter()
    traces = await asyncio.gather(*(_stream(http, model, p, max_tokens) for p in prompts))
    end = max(t.ended or t0 for t in traces)
    ttft = [((t.first_token or end) - t.submitted) * 1000 for t in traces]
    return Run(sum(t.tokens for t in traces), end - t0, ttft)


async def _stream(http: SseClient, model: str, prompt: str, max_tokens: int) -> _Trace:
    trace = _Trace(time.perf_counter())
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    # Read to the response's end, past [DONE] (the chunked body's last chunk follows it at once): a stream left
    # unfinished cannot hand its connection back, and each request would open a new one inside its TTFT.
    async for data in http.events("/v1/completions", body):
        if data == b"[DONE]":
            trace.ended = time.perf_counter()
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the gateway's stream failed: {chunk['error']}")
        if trace.first_token is None and chunk["choices"] and chunk["choices"][0]["text"]:
            trace.first_token = time.perf_counter()
        if chunk.get("usage"):
            trace.tokens = chunk["usage"]["completion_tokens"]
    trace.ended = trace.ended or time.perf_counter()
    return trace
