"""The bench's results: results.json, a short results.md (printed too) and chart.png.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mlxq.api.errors import install_hint

from ..blas import OPENBLAS
from .chart import Panel, Series, draw
from .runs import PROMPT, BenchResult

__all__ = ["render_markdown", "write_outputs"]


def write_outputs(result: BenchResult, out: Path) -> str:
    """Write results.json, results.md and chart.png into ``out``; returns the markdown."""
    (out / "results.json").write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    md = render_markdown(result)
    (out / "results.md").write_text(md)
    draw(_panels(result), f"mlxq bench · {Path(result.model).name} · BLAS: {result.machine['blas'].split(' ')[0]} · "
         f"{result.machine['cpus']} cores", out / "chart.png")
    return md


def render_markdown(result: BenchResult) -> str:
    """A header, how the runs were made, and one table: tok/s and TTFT p50 per path, the ratios to raw."""
    m, c = result.machine, result.config
    gateway = all(r.gateway is not None for r in result.rows)
    lines = [
        "# mlxq bench", "",
        f"Model `{result.model}` · {m['date']} · {m['cpus']} cores · BLAS: **{m['blas']}** · mlx {m['mlx']} · "
        f"mlx-lm {m['mlx_lm']} · python {m['python']} · run time {result.seconds:.0f} s", "",
        *([f"**Warning: mlx-cpu's bundled BLAS ran; batching gains little with it** (install OpenBLAS: "
           f"`apt-get install libopenblas0-pthread`, then `mlxq bench` preloads {OPENBLAS}).", ""]
          if m["blas"].startswith("bundled") else []),
        f"At each N, a burst of N requests at once (prompts \"{PROMPT}\", greedy, max_tokens {c.max_tokens}) on "
        "each path in turn: **raw** = mlx-lm's `BatchGenerator` in this process (the ceiling; the idle worker "
        "stopped meanwhile), **queue** = client -> Redis -> `arq mlxq.worker.Settings` -> client"
        + (", **gateway** = `mlxq gateway` in front of the same worker, streamed over HTTP" if gateway else "")
        + f". tok/s: completion tokens / (first submit -> last end), best of {c.repeats} run(s) after a warm-up; "
        "ratios: the median over the runs of each run's tok/s / the raw run's just before it; TTFT: submit -> "
        "first token, over every run.", "",
    ]
    if gateway:
        lines += ["| N | raw tok/s | queue tok/s | gateway tok/s | queue/raw | gateway/raw "
                  "| TTFT p50 ms raw / queue / gateway |", "|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| N | raw tok/s | queue tok/s | queue/raw | TTFT p50 ms raw / queue |", "|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        if r.gateway is not None and gateway:
            lines.append(f"| {r.n} | {r.raw.tok_s:.1f} | {r.queue.tok_s:.1f} | {r.gateway.tok_s:.1f} "
                         f"| {r.queue_over_raw:.2f} | {r.gateway_over_raw or 0.0:.2f} | {r.raw.ttft_p50_ms:.1f} / "
                         f"{r.queue.ttft_p50_ms:.1f} / {r.gateway.ttft_p50_ms:.1f} |")
        else:
            lines.append(f"| {r.n} | {r.raw.tok_s:.1f} | {r.queue.tok_s:.1f} | {r.queue_over_raw:.2f} "
                         f"| {r.raw.ttft_p50_ms:.1f} / {r.queue.ttft_p50_ms:.1f} |")
    if not gateway:
        lines += ["", f"The gateway was not measured: its extra is not installed (`{install_hint('gateway')}`)."]
    return "\n".join([*lines, ""])


def _panels(result: BenchResult) -> list[Panel]:
    ns = [r.n for r in result.rows]
    picks = {"raw mlx-lm": [r.raw for r in result.rows], "queue": [r.queue for r in result.rows]}
    gateway = [r.gateway for r in result.rows if r.gateway is not None]
    if len(gateway) == len(ns):
        picks["HTTP gateway"] = gateway
    return [Panel("throughput", "aggregate tok/s", [Series(k, ns, [p.tok_s for p in v]) for k, v in picks.items()]),
            Panel("time to first token", "TTFT p50 ms",
                  [Series(k, ns, [p.ttft_p50_ms for p in v]) for k, v in picks.items()])]
