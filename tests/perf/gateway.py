"""The HTTP gateway phase: ``mlxq gateway`` (a child process) in front of the queue worker, measured beside the
in-process client on the same worker, with the CPU of each path's processes and a TTFT probe at N = 1.

Both paths stream the same prompts greedily (``mlxq.worker.tools.bench.paths``: the client as the queue path
does, the gateway through ``POST /v1/completions`` read by the product bench's lean HTTP client, since a heavier
one would be measured more than the gateway). Runs alternate, queue then gateway, each after the same idle
pause; TTFT is submit (or request) -> first text.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from urllib.parse import urlsplit

from mlxq.api.client import Client
from mlxq.worker.tools.bench.http import SseClient
from mlxq.worker.tools.bench.paths import run_gateway, run_queue
from mlxq.worker.tools.bench.runs import (
    SETTLE_S,
    PathResult,
    Run,
    paired_median,
    percentile,
    prompt_batch,
    safe_ratio,
    say,
)
from mlxq.worker.tools.process import GatewayProcess

from .paths import DriveContext, cpu_seconds
from .runs import PROBE_OFFSET, PROBE_TOKENS, GatewayProbe, GatewayResult, GatewayRow, fmt_runs

__all__ = ["gateway_phase"]

_NEEDS = ("starlette", "uvicorn")


async def gateway_phase(ctx: DriveContext, client: Client) -> GatewayResult | None:
    """Start a gateway on the worker's deployment and measure it against ``client`` at every N, then TTFT."""
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        say(f"[{ctx.model}] gateway: skipped ({', '.join(missing)} missing: pip install 'mlxq[bench]')")
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

    def __init__(self, ctx: DriveContext, gateway_pid: int) -> None:
        self.queue = ctx.meter.fresh()
        self.gateway = ctx.meter.fresh()
        self.gateway_pid = gateway_pid
        self.gateway_s = 0.0


async def _drive(ctx: DriveContext, client: Client, url: str, gateway_pid: int) -> GatewayResult:
    cfg = ctx.cfg
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    http = SseClient(where.hostname, where.port)
    try:
        await run_gateway(http, ctx.model, ["warm up"], cfg.warmup_tokens)
        meters = _Meters(ctx, gateway_pid)
        rows = [await _measure_at(ctx, client, http, n, meters) for n in cfg.concurrency]
        probe = await _probe(ctx, client, http)
    finally:
        await http.aclose()
    return GatewayResult(rows, probe, meters.queue.stop(), meters.gateway.stop(), meters.gateway_s)


async def _measure_at(ctx: DriveContext, client: Client, http: SseClient, n: int, meters: _Meters
                      ) -> GatewayRow:
    """Warm both paths at N, then alternate measured runs: queue (the in-process client), gateway."""
    prompts, cfg = prompt_batch(n), ctx.cfg
    await run_queue(client, ctx.model, prompts, cfg.warmup_tokens)
    await run_gateway(http, ctx.model, prompts, cfg.warmup_tokens)
    queue_runs: list[Run] = []
    gateway_runs: list[Run] = []
    for _ in range(cfg.repeats_for(ctx.model)):
        time.sleep(SETTLE_S)  # every run after the same idle pause (see paths.frozen)
        with meters.queue.running():
            queue_runs.append(await run_queue(client, ctx.model, prompts, cfg.max_tokens))
        time.sleep(SETTLE_S)
        before = cpu_seconds(meters.gateway_pid)
        with meters.gateway.running():
            gateway_runs.append(await run_gateway(http, ctx.model, prompts, cfg.max_tokens))
        meters.gateway_s += cpu_seconds(meters.gateway_pid) - before
    q, g = PathResult.of(queue_runs), PathResult.of(gateway_runs)
    say(f"[{ctx.model}] N={n:<3} queue {q.tok_s:8.1f} tok/s (runs {fmt_runs(q)}); "
         f"gateway {g.tok_s:8.1f} tok/s (runs {fmt_runs(g)})")
    return GatewayRow(n, q, g, safe_ratio(g.tok_s, q.tok_s), paired_median(g.runs_tok_s, q.runs_tok_s),
                      g.ttft_p50_ms - q.ttft_p50_ms, g.ttft_p99_ms - q.ttft_p99_ms)


async def _probe(ctx: DriveContext, client: Client, http: SseClient) -> GatewayProbe:
    """TTFT of single requests, queue and gateway in turn."""
    queue: list[float] = []
    gateway: list[float] = []
    for k in range(ctx.cfg.ttft_probes):
        prompts = prompt_batch(1, PROBE_OFFSET + k)
        queue += (await run_queue(client, ctx.model, prompts, PROBE_TOKENS)).ttft_ms
        gateway += (await run_gateway(http, ctx.model, prompts, PROBE_TOKENS)).ttft_ms
    q50, q99, g50, g99 = percentile(queue, 50), percentile(queue, 99), percentile(gateway, 50), percentile(gateway, 99)
    probe = GatewayProbe(min(len(queue), len(gateway)), q50, q99, g50, g99, g50 - q50, g99 - q99)
    say(f"[{ctx.model}] gateway TTFT at N=1: p50 {g50:.1f} ms (queue {q50:.1f}), p99 {g99:.1f} ms (queue {q99:.1f})")
    return probe
