"""The research run's report: its targets (tests/perf/README.md lists them), each PASS or MISS, results.json, the
tables of results.md and chart.png.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mlxq.worker.tools.bench.chart import Panel, Series, draw
from mlxq.worker.tools.bench.runs import PROMPT, fmt_list, percentile
from mlxq.worker.tools.blas import OPENBLAS

from .models import md_models
from .results import BenchResult, SizeResult
from .runs import BLAS_MARGIN, PROBE_TOKENS, EnqueueResult, Target, fmt, num
from .vision import md_vision

_MIB = 1 << 20


# --- targets ---------------------------------------------------------------------------------------
def size_targets(sizes: list[SizeResult], enqueue: EnqueueResult) -> list[Target]:
    """The targets of issue #3 that this run measured."""
    out: list[Target] = []
    for s in sizes:
        floor = 0.95 if s.size == "small" else 0.80
        for r in s.rows:
            if r.n > 1:
                out.append(_at_least(f"queue/raw {s.size} N={r.n} (best runs)", r.queue_over_raw, floor))
                out.append(_at_least(f"queue/raw {s.size} N={r.n} (median of pairs)", r.queue_over_raw_paired, floor))
        out += [_at_least(f"queue/serial {s.size} N=32", r.queue_over_serial, 6.0)
                for r in s.rows if r.n == 32 and s.size == "small"]
        out.append(_at_most(f"queue-added TTFT p50 {s.size} N=1", s.ttft_n1.added_p50_ms, 10.0, " ms"))
        out.append(_at_most(f"queue-added TTFT p99 {s.size} N=1", s.ttft_n1.added_p99_ms, 50.0, " ms"))
        c = s.cancel
        if c.p99_ms is not None and c.budget_ms is not None:
            out.append(_at_most(f"cancel p99 {s.size} (step {c.step_ms_mean:.1f} ms + 50)", c.p99_ms,
                                c.budget_ms, " ms"))
        out.append(_at_most(f"round trips per step {s.size}", s.round_trips.queue_writes_per_step, 1.0, ""))
        out += _peer_targets(s)
        out += _scheduling_targets(s)
        out += _gateway_targets(s)
    out.append(_at_least("enqueue jobs/s (sequential awaits)", enqueue.sequential_jobs_s, 2000.0))
    return out


def _peer_targets(s: SizeResult) -> list[Target]:
    """Issue #29's: a burst's TTFT p50 no later than mlx_lm.server's at N = 8 and 32, at >= 0.95 of raw tok/s."""
    out = []
    for r in s.rows:
        if r.server is not None and r.n in (8, 32):
            out.append(_at_most(f"TTFT p50 queue - mlx_lm.server {s.size} N={r.n}",
                                r.queue.ttft_p50_ms - r.server.ttft_p50_ms, 0.0, " ms"))
    return out


def _scheduling_targets(s: SizeResult) -> list[Target]:
    """Issue 16's targets: the prefix cache's TTFT (small model), admission under over-subscription, priority."""
    sch = s.scheduling
    if sch is None:
        return []
    o, p = sch.oversubscribed, sch.priority
    out = [_at_least(f"prefix-cache TTFT speedup {s.size}", sch.prefix.speedup, 10.0)] if s.size == "small" else []
    return [*out,
            _at_most(f"over-subscribed peak KV / headroom {s.size}", o.peak_kv_bytes / o.headroom_bytes, 1.0, ""),
            _at_least(f"over-subscribed jobs completed {s.size}", o.completed / o.expected if o.expected else 0, 1.0),
            _at_least(f"over-subscribed tok/s / unlimited {s.size} (best runs)", o.best_ratio, 0.9),
            _at_most(f"priority TTFT / (prefill + 2 decode steps) {s.size}",
                     p.ttft_p50_ms / p.budget_ms if p.budget_ms else 0.0, 1.0, ""),
            *_structured_targets(s)]


def _structured_targets(s: SizeResult) -> list[Target]:
    """Issue #27's: half the batch constrained keeps 0.9 of its tok/s free; a seen schema adds <= 5 ms TTFT."""
    st = s.scheduling.structured if s.scheduling is not None else None
    if st is None:
        return []
    return [_at_least(f"half constrained / free tok/s {s.size} N={st.jobs} (median of pairs)", st.paired_ratio, 0.9),
            _at_most(f"constrained-added TTFT p50 {s.size} N=1", st.ttft_p50_ms - st.free_ttft_p50_ms, 5.0, " ms"),
            _at_least(f"constrained outputs valid {s.size}", st.valid / st.checked if st.checked else 0.0, 1.0)]


def _gateway_targets(s: SizeResult) -> list[Target]:
    """Issue #15's: streaming through the gateway keeps 0.95 of the in-process client's throughput at every N
    and adds at most 5 ms to a lone request's TTFT (p50)."""
    if s.gateway is None:
        return []
    out = []
    for r in s.gateway.rows:
        out.append(_at_least(f"gateway/queue {s.size} N={r.n} (best runs)", r.gateway_over_queue, 0.95))
        out.append(_at_least(f"gateway/queue {s.size} N={r.n} (median of pairs)", r.gateway_over_queue_paired, 0.95))
    out.append(_at_most(f"gateway-added TTFT p50 {s.size} N=1", s.gateway.probe.added_p50_ms, 5.0, " ms"))
    return out


def _at_least(name: str, value: float, limit: float) -> Target:
    return Target(name, value, f">= {limit:g}", value >= limit)


def _at_most(name: str, value: float, limit: float, unit: str) -> Target:
    return Target(name, value, f"<= {limit:.1f}{unit}", value <= limit)


# --- output ----------------------------------------------------------------------------------------
def write_outputs(result: BenchResult, out: Path) -> str:
    """Write results.json, results.md and chart.png into ``out``; returns the markdown."""
    (out / "results.json").write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    md = render_markdown(result)
    (out / "results.md").write_text(md)
    m = result.machine
    title = f"mlxq research bench · BLAS: {m['blas'].split(' ')[0]} · {m['cpus']} cores"
    draw([_panel(s) for s in result.sizes], title, out / "chart.png")
    return md


def _panel(s: SizeResult) -> Panel:
    """One model size's throughput per path (chart.png)."""
    ns = [r.n for r in s.rows]
    series = [Series(label, ns, [pick(r).tok_s for r in s.rows]) for label, pick in (
        ("raw BatchGenerator", lambda r: r.raw), ("queue", lambda r: r.queue), ("serial", lambda r: r.serial))]
    if s.gateway is not None:
        series.append(Series("HTTP gateway", [r.n for r in s.gateway.rows], [r.gateway.tok_s for r in s.gateway.rows],
                             marker="s", linestyle="--"))
    engine = [r.engine.tok_s for r in s.rows if r.engine is not None]
    if len(engine) == len(ns):
        series.append(Series("engine, no Redis", ns, engine, marker=".", linestyle=":"))
    return Panel(f"{s.size} model", "aggregate tok/s", series)


def render_markdown(result: BenchResult) -> str:
    """``results.md``: a header, the main table, then one section per measurement and the targets."""
    return "\n".join([*_md_header(result), *_md_table(result), *_md_engine(result), *_md_peer(result),
                      *_md_gateway(result),
                      *md_blas(result),
                      *_md_policy(result),
                      *_md_ttft(result), *_md_cancel(result), *_md_round_trips(result), *_md_cpu(result),
                      *_md_scheduling(result), *md_vision(result.vision, result.config), *md_models(result.models),
                      *_md_enqueue(result), *_md_targets(result)])


def _md_header(result: BenchResult) -> list[str]:
    m, c = result.machine, result.config
    return [
        "# mlxq research bench (python3 -m tests.perf)", "",
        f"{m['date']} · {m['cpus']} cores · BLAS: **{m['blas']}** · mlx {m['mlx']} · "
        f"mlx-lm {m['mlx_lm']} · mlx-vlm {m.get('mlx_vlm', '?')} · arq {m['arq']} · redis {m.get('redis', '?')} · "
        f"python {m['python']} · "
        f"run time {result.seconds:.0f} s · load average at start {m['loadavg_start']}, "
        f"at end {m.get('loadavg_end', '?')}; a fixed Python loop took {m['probe_ms_start']} ms at the start, "
        f"{m.get('probe_ms_end', '?')} ms at the end (other tenants skew every number)",
        "",
        "Worker settings: " + ", ".join(f"`{k}={v}`" for k, v in m.get("worker_env", {}).items()) + ".",
        "",
        *([f"**Warning: mlx-cpu's bundled BLAS ran; batching gains little with it** (install OpenBLAS: "
           f"`apt-get install libopenblas0-pthread`, then `python3 -m tests.perf` preloads {OPENBLAS}).", ""]
          if m["blas"].startswith("bundled") else []),
        f"Generated random-weight models; greedy; max_tokens {c.max_tokens}; prompts \"{PROMPT}\". "
        f"Throughput: best of {c.repeats} run(s) ({c.tiny_repeats} for the tiny model) for raw and queue, "
        "which alternate run by run at each N, with an engine run between them "
        "(the idle queue worker SIGSTOPped during raw and engine runs), and of "
        f"{c.serial_repeats} for serial, each after a warm-up. Aggregate tok/s = completion tokens / "
        "(first submit → last terminal event; raw: insert → last token). TTFT pooled over those runs "
        "(raw: insert → first token; queue: submit → first token event). queue/raw = best queue run / best "
        "raw run; queue/raw paired = the median, over the run pairs, of each queue run / the raw run just "
        "before it (robust to the machine's slow swings).",
        "",
    ]


def _md_table(result: BenchResult) -> list[str]:
    lines = ["## Throughput and TTFT", "",
             "| size | N | raw tok/s | queue tok/s | serial tok/s | queue/raw | queue/raw paired | queue/serial "
             "| TTFT p50 ms raw / queue / added | TTFT p99 ms raw / queue / added |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        for r in s.rows:
            lines.append(
                f"| {s.size} | {r.n} | {r.raw.tok_s:.1f} | {r.queue.tok_s:.1f} | {r.serial.tok_s:.1f} "
                f"| {r.queue_over_raw:.2f} | {r.queue_over_raw_paired:.2f} | {r.queue_over_serial:.2f} "
                f"| {r.raw.ttft_p50_ms:.1f} / {r.queue.ttft_p50_ms:.1f} / {r.added_ttft_p50_ms:+.1f} "
                f"| {r.raw.ttft_p99_ms:.1f} / {r.queue.ttft_p99_ms:.1f} / {r.added_ttft_p99_ms:+.1f} |")
    return [*lines, ""]


def _md_engine(result: BenchResult) -> list[str]:
    rows = [(s.size, r) for s in result.sizes for r in s.rows if r.engine is not None]
    if not rows:
        return []
    lines = ["## Where the queue's cost goes", "",
             "engine = the worker's own engine (scheduler, detokenizers, pacer, admission wait; the worker's "
             "defaults) driven in this process on the raw path's MLX thread, without Redis, run between each "
             "raw and queue run. engine/raw is the engine's bookkeeping; queue/engine the transport (client, "
             "Redis, arq, the worker's event loop and the CPU they take from the model on this machine). "
             "Ratios are medians over the run triples.", "",
             "| size | N | raw tok/s | engine tok/s | queue tok/s | engine/raw | queue/engine | queue/raw "
             "| TTFT p50 ms raw / engine / queue |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, r in rows:
        assert r.engine is not None
        lines.append(f"| {size} | {r.n} | {r.raw.tok_s:.1f} | {r.engine.tok_s:.1f} | {r.queue.tok_s:.1f} "
                     f"| {r.engine_over_raw_paired:.2f} | {r.queue_over_engine_paired:.2f} "
                     f"| {r.queue_over_raw_paired:.2f} | {r.raw.ttft_p50_ms:.1f} / {r.engine.ttft_p50_ms:.1f} / "
                     f"{r.queue.ttft_p50_ms:.1f} |")
    return [*lines, ""]


def _md_peer(result: BenchResult) -> list[str]:
    rows = [(s.size, r) for s in result.sizes for r in s.rows if r.server is not None]
    if not rows:
        return []
    lines = ["## mlx_lm.server, the peer", "",
             "`mlx_lm.server` (mlx-lm's own HTTP server, the same BatchGenerator; `tests/perf/peer.py`) on the "
             "same model and prompts, with the worker's capacity and prefill batch, its prompt cache off and its "
             "listen backlog raised to 128 (at its default of 5 a burst's connections beyond it wait a second), "
             "streamed (`POST /v1/completions`), each run after the queue's run of the same N (the worker stopped "
             "meanwhile). TTFT: the burst's start -> each request's first text. queue/server: median over the "
             "run pairs.", "",
             "| size | N | raw tok/s | queue tok/s | mlx_lm.server tok/s | queue/server | TTFT p50 ms raw / queue / "
             "server | TTFT p99 ms queue / server |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size, r in rows:
        assert r.server is not None
        lines.append(f"| {size} | {r.n} | {r.raw.tok_s:.1f} | {r.queue.tok_s:.1f} | {r.server.tok_s:.1f} "
                     f"| {r.queue_over_server_paired:.2f} | {r.raw.ttft_p50_ms:.1f} / {r.queue.ttft_p50_ms:.1f} / "
                     f"{r.server.ttft_p50_ms:.1f} | {r.queue.ttft_p99_ms:.1f} / {r.server.ttft_p99_ms:.1f} |")
    return [*lines, ""]


def _md_gateway(result: BenchResult) -> list[str]:
    sizes = [s for s in result.sizes if s.gateway is not None]
    if not sizes:
        return []
    c = result.config
    lines = ["## HTTP gateway", "",
             "`mlxq gateway` (a child process) in front of the same queue worker, streamed over HTTP "
             "(`POST /v1/completions`, `stream_options.include_usage`; read by a lean keep-alive HTTP/1.1 client, "
             "`worker/tools/bench/http.py`, the product bench's) "
             "against the in-process client (queue), run by run in turn at each N after the same idle pause: "
             f"best of {c.repeats} pair(s) ({c.tiny_repeats} for the tiny model). TTFT: request -> first text "
             "chunk (queue: submit -> first token event). paired = median over the pairs of gateway run / queue "
             "run.", "",
             "| size | N | queue tok/s | gateway tok/s | gateway/queue | paired "
             "| TTFT p50 ms queue / gateway / added | TTFT p99 ms queue / gateway / added |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sizes:
        assert s.gateway is not None
        for r in s.gateway.rows:
            lines.append(
                f"| {s.size} | {r.n} | {r.queue.tok_s:.1f} | {r.gateway.tok_s:.1f} | {r.gateway_over_queue:.2f} "
                f"| {r.gateway_over_queue_paired:.2f} "
                f"| {r.queue.ttft_p50_ms:.1f} / {r.gateway.ttft_p50_ms:.1f} / {r.added_ttft_p50_ms:+.1f} "
                f"| {r.queue.ttft_p99_ms:.1f} / {r.gateway.ttft_p99_ms:.1f} / {r.added_ttft_p99_ms:+.1f} |")
    lines += ["", f"TTFT at N=1 ({c.ttft_probes} sequential single requests per path, in turn; max_tokens "
              f"{PROBE_TOKENS}) and CPU over the measured runs (cores busy: bench + worker + Redis + gateway "
              "CPU seconds per wall second):", "",
              "| size | queue p50 | gateway p50 | added p50 | queue p99 | gateway p99 | added p99 "
              "| cores busy queue / gateway | gateway process CPU s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sizes:
        g = s.gateway
        assert g is not None
        p, cq, cg = g.probe, g.cpu_queue, g.cpu_gateway
        busy_q = (cq.bench_s + cq.worker_s + cq.redis_s) / cq.wall_s if cq.wall_s else 0.0
        busy_g = (cg.bench_s + cg.worker_s + cg.redis_s + g.gateway_s) / cg.wall_s if cg.wall_s else 0.0
        lines.append(f"| {s.size} | {p.queue_p50_ms:.1f} | {p.gateway_p50_ms:.1f} | {p.added_p50_ms:+.1f} "
                     f"| {p.queue_p99_ms:.1f} | {p.gateway_p99_ms:.1f} | {p.added_p99_ms:+.1f} "
                     f"| {busy_q:.2f} / {busy_g:.2f} | {g.gateway_s:.2f} |")
    return [*lines, ""]


def md_blas(result: BenchResult) -> list[str]:
    rows = [(s.size, s.blas_threads) for s in result.sizes if s.blas_threads is not None]
    if not rows:
        return []
    n = result.config.capacity
    lines = ["## OpenBLAS threads", "",
             f"Chosen per size before its runs: raw at N={n} with each thread count, alternating; the fewest "
             f"threads whose median is within {BLAS_MARGIN:.0%} of the best is the ceiling's setting, and the "
             "queue and serial workers run with it too (`OPENBLAS_NUM_THREADS`).", "",
             "| size | threads | raw tok/s per thread count (runs) |", "|---|---:|---|"]
    for size, t in rows:
        runs = "; ".join(f"{k}: {fmt_list(v)}" for k, v in sorted(t.raw_tok_s.items()))
        lines.append(f"| {size} | {t.chosen} | {runs} |")
    return [*lines, ""]


def _md_policy(result: BenchResult) -> list[str]:
    rows = [(s.size, s.kernel_policy) for s in result.sizes if s.kernel_policy is not None]
    if not rows:
        return []
    lines = ["## MLX's kernel thread: SCHED_BATCH", "",
             "On Linux MLX runs a CPU stream's kernels on a thread of its own, woken for each kernel; mlxq's MLX "
             "threads (the worker's engines and this bench's raw path alike) put it under SCHED_BATCH, whose "
             "wake-ups do not preempt the thread enqueuing them (engine/mlx/thread.py). Raw runs under each "
             "policy, in turn, each after the same idle pause:", "",
             "| size | N | default tok/s (median) | SCHED_BATCH tok/s (median) | SCHED_BATCH / default (paired) |",
             "|---|---:|---:|---:|---:|"]
    for size, p in rows:
        for n, ratio in p.batch_over_default_paired.items():
            lines.append(f"| {size} | {n} | {percentile(p.raw_tok_s['default'][n], 50):.0f} "
                         f"| {percentile(p.raw_tok_s['batch'][n], 50):.0f} | {ratio:.2f} |")
    return [*lines, ""]


def _md_ttft(result: BenchResult) -> list[str]:
    lines = ["## TTFT at N=1", "",
             f"{result.config.ttft_probes} sequential single requests per path, raw and queue in turn "
             f"(max_tokens {PROBE_TOKENS}).", "",
             "| size | raw p50 | raw p99 | queue p50 | queue p99 | added p50 | added p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        p = s.ttft_n1
        lines.append(f"| {s.size} | {p.raw_p50_ms:.1f} | {p.raw_p99_ms:.1f} | {p.queue_p50_ms:.1f} "
                     f"| {p.queue_p99_ms:.1f} | {p.added_p50_ms:+.1f} | {p.added_p99_ms:+.1f} |")
    return [*lines, ""]


def _md_cancel(result: BenchResult) -> list[str]:
    c0 = result.config
    lines = ["## Cancel → terminal event", "",
             f"{c0.capacity} jobs at once on the queue worker (max_tokens {c0.cancel_max_tokens}); each is "
             f"cancelled after {c0.cancel_wait[0]}..{c0.cancel_wait[1]} of its token events; timed by the "
             "client. Decode step = a job's time per generated token before its cancel (an event carries "
             "several tokens when steps are faster than the stream interval).", "",
             "| size | jobs | cancelled | p50 ms | p99 ms | max ms | decode step ms "
             "| budget ms (step + 50) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        c = s.cancel
        lines.append(f"| {s.size} | {c.jobs} | {c.cancelled} | {fmt(c.p50_ms)} | {fmt(c.p99_ms)} "
                     f"| {fmt(c.max_ms)} | {fmt(c.step_ms_mean)} | {fmt(c.budget_ms)} |")
    return [*lines, ""]


def _md_round_trips(result: BenchResult) -> list[str]:
    lines = ["## Redis round trips per engine step", "",
             "From each worker's metrics endpoint, scraped after its last run (its whole life: warm-up, runs, "
             "probes, cancels): event-publishing pipelines / engine steps. Commands: Redis `INFO commandstats` "
             "deltas over the queue path's throughput runs (every client: worker, arq, producer).", "",
             "| size | worker | engine steps | redis writes | events | other counters | writes/step "
             "| publish | xadd | all commands | top commands |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in result.sizes:
        t = s.round_trips
        for kind, w in (("queue", t.queue_worker), ("serial", t.serial_worker)):
            cmd = "- | - | - | -"
            if kind == "queue":
                c = t.commandstats
                top = ", ".join(f"{k} {v}" for k, v in list(c.items())[1:6])
                cmd = f"{c.get('publish', 0)} | {c.get('xadd', 0)} | {c.get('total', 0)} | {top}"
            other = " ".join(f"{k}={v}" for k, v in w.other.items()) or "-"
            lines.append(f"| {s.size} | {kind} | {w.engine_steps} | {w.redis_writes} | {w.events} "
                         f"| {other} | {w.writes_per_step:.3f} | {cmd} |")
    return [*lines, ""]


def _md_cpu(result: BenchResult) -> list[str]:
    cpus = result.machine["cpus"] or 1
    lines = ["## CPU during the throughput runs", "",
             f"CPU seconds per process over the measured runs (warm-ups excluded); {cpus} cores give "
             f"{cpus} s per wall second. bench = this process (the model on the raw path, the client otherwise).",
             "", "| size | path | wall s | bench s | worker s | redis s | cores busy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        for path, c in s.cpu.items():
            busy = (c.bench_s + c.worker_s + c.redis_s) / c.wall_s if c.wall_s else 0.0
            lines.append(f"| {s.size} | {path} | {c.wall_s:.2f} | {c.bench_s:.2f} | {c.worker_s:.2f} "
                         f"| {c.redis_s:.2f} | {busy:.2f} |")
    return [*lines, ""]


def _md_enqueue(result: BenchResult) -> list[str]:
    e = result.enqueue
    return ["## Enqueue rate", "",
            f"One producer, {e.jobs} `client.submit` calls into a queue no worker serves "
            "(its keys deleted after).", "",
            "| producer | jobs/s |", "|---|---:|",
            f"| sequential awaits | {e.sequential_jobs_s:.0f} |",
            f"| asyncio.gather, batches of {e.gather_batch} | {e.gathered_jobs_s:.0f} |", ""]


def _md_scheduling(result: BenchResult) -> list[str]:
    sizes = [(s.size, s.scheduling) for s in result.sizes if s.scheduling is not None]
    if not sizes:
        return []
    c = result.config
    lines = ["## Scheduling: prefix cache, KV admission, priority", "",
             "The worker's own engine in this process, on the raw path's MLX thread (no Redis). **Prefix cache**: "
             f"chat jobs (max_tokens 2) with one long system prompt, {c.scheduling_probes} probes each, alternating: "
             "cold on an engine without a prefix cache, cached on one that holds the system prompt. TTFT = added "
             "-> first token leaves the engine.", "",
             "| size | system prompt tokens | prompt tokens | TTFT p50 cold ms | cached ms | speedup | hits "
             "| tokens saved |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size, sch in sizes:
        p = sch.prefix
        lines.append(f"| {size} | {p.system_tokens} | {p.prompt_tokens} | {p.cold_p50_ms:.1f} | {p.warm_p50_ms:.1f} "
                     f"| {p.speedup:.1f} | {p.hits} | {p.tokens_saved} |")
    lines += ["", f"**KV over-subscription**: 3 x slots jobs at once (prompts \"{PROMPT}\", max_tokens drawn from "
              f"{c.max_tokens // 2}..{c.max_tokens * 3 // 2}), their KV demand by the engine's own estimate 3x the "
              "headroom; against the same jobs with the same slots and no KV limit, "
              f"{c.scheduling_repeats} round(s) alternating after a warm-up. Peak KV = the caches' measured bytes "
              "after a step (mlx-lm's prompt_cache_nbytes plus preempted caches held); peak RSS of this process "
              "and MLX's peak memory (model included) during the limited runs.", "",
              "| size | jobs | slots | headroom MiB | demand / headroom | peak KV / headroom "
              "| unlimited peak / headroom | completed | tok/s limited | tok/s unlimited | best ratio | paired "
              "| most running | peak RSS MiB "
              "| MLX peak MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, sch in sizes:
        o = sch.oversubscribed
        h = o.headroom_bytes
        lines.append(f"| {size} | {o.jobs} | {o.capacity} | {h / _MIB:.1f} | {o.demand_bytes / h:.2f} "
                     f"| {o.peak_kv_bytes / h:.2f} | {o.unlimited_peak_kv_bytes / h:.2f} | {o.completed}/{o.expected} "
                     f"| {fmt_list(o.tok_s)} | {fmt_list(o.unlimited_tok_s)} | {o.best_ratio:.2f} "
                     f"| {o.paired_ratio:.2f} | {o.most_running} | {o.peak_rss_bytes / _MIB:.0f} "
                     f"| {o.mlx_peak_bytes / _MIB:.0f} |")
    lines += ["", "**Priority**: every slot decoding a long job, then one job of priority 100 at a random point of "
              f"a step ({c.scheduling_probes} probes, one at a time; each preempts a long job); against its TTFT on "
              "an idle engine (one prefill, to its first token) plus two decode steps of the full batch. For "
              "comparison, the same job with priority 0 joining the one free slot of a batch otherwise full (no "
              "preemption): a sequence joining or leaving mlx-lm's batch copies the batch's caches.", "",
              "| size | background jobs | TTFT p50 ms | one prefill ms | decode step ms | budget ms "
              "| joining a free slot ms | preemptions |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size, sch in sizes:
        q = sch.priority
        lines.append(f"| {size} | {q.background} | {q.ttft_p50_ms:.1f} | {q.idle_ttft_ms:.1f} | {q.step_ms:.1f} "
                     f"| {q.budget_ms:.1f} | {q.join_ttft_p50_ms:.1f} | {q.preemptions} |")
    return [*lines, "", *_md_structured(sizes, c)]


def _md_structured(sizes: list[tuple[str, Any]], c: Any) -> list[str]:
    rows = [(size, sch.structured) for size, sch in sizes if sch.structured is not None]
    if not rows:
        return []
    lines = ["**Structured output**: a full batch (max_tokens as above) with every other row constrained to a JSON "
             "schema whose string runs to max_tokens (so every row makes as many tokens), against the same batch "
             f"free, {c.scheduling_repeats * 2} pairs alternating; then N = 1 TTFT probes (max_tokens 2) "
             "alternating free and constrained (the schema compiled before); and a new schema's compile time "
             "(llguidance, off the engine thread in a worker).", "",
             "| size | jobs | constrained | tok/s half constrained | tok/s free | paired ratio "
             "| TTFT p50 constrained ms | free ms | compile ms | valid |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, st in rows:
        lines.append(f"| {size} | {st.jobs} | {st.constrained} | {fmt_list(st.tok_s)} | {fmt_list(st.free_tok_s)} "
                     f"| {st.paired_ratio:.2f} | {st.ttft_p50_ms:.1f} | {st.free_ttft_p50_ms:.1f} "
                     f"| {st.compile_ms:.1f} | {st.valid}/{st.checked} |")
    return [*lines, ""]


def _md_targets(result: BenchResult) -> list[str]:
    lines = ["## Targets", "", "| target | value | limit | result |", "|---|---:|---:|---|"]
    lines += [f"| {t.name} | {num(t.value)} | {t.limit} | {'PASS' if t.passed else '**MISS**'} |"
              for t in result.targets]
    return [*lines, ""]
