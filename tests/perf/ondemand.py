"""Research run: models loaded on demand (``python3 -m tests.perf.ondemand``; a few tens of seconds on the
generated small model). Prints its figures side by side with the targets of issue 51, item 2:

- **cold start**: a job for an unloaded model starts (its ``start`` event) within the model's load time + 1 s
  (the load time measured by the worker);
- **mixed load**: three models on a weight budget for two, jobs for all three in waves: no job lost or failed,
  exactly one terminal event each, and how many loads and unloads it took;
- **memory**: after each unload, MLX's active memory within 5 % of what it was before that model's load.

One in-process worker (a real arq worker on a private Redis server), copies of the generated small model under
three names. Results go to stdout only; the machine it runs on is named in the output (a shared machine's
figures are noisy).
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxq.api.client import Client
from mlxq.worker.budget import weights_bytes
from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.redis_server import RedisServer
from mlxq.worker.tools.tinymodel import ensure_model
from tests.support import start_worker

_NAMES = ("a", "b", "c")
_WAVES, _PER_WAVE = 6, 9  # mixed load: 54 jobs


async def _job(client: Client, model: str, prompt: str, max_tokens: int) -> tuple[list[Any], float, float]:
    """A job's events, when it was submitted and when its start event came (monotonic)."""
    t0 = time.monotonic()
    rid = await client.submit(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, require_worker=True)
    events, started = [], 0.0
    async for ev in client.events(rid, timeout=300):
        if ev.type == "start" and not started:
            started = time.monotonic()
        events.append(ev)
    return events, t0, started


async def _cold_start(client: Client, host: Any) -> dict[str, float]:
    events, t0, started = await _job(client, "a", "Once upon a time", 8)
    assert events[-1].type == "done", events[-1]
    load_s = host.services["a"].load_s or 0.0
    return {"start_s": started - t0, "load_s": load_s}


async def _mixed(client: Client, host: Any) -> dict[str, int]:
    ends: list[str] = []
    for wave in range(_WAVES):
        models = [_NAMES[(wave + i) % 3] if i % 4 else _NAMES[wave % 3] for i in range(_PER_WAVE)]
        results = await asyncio.gather(*(_job(client, m, f"wave {wave} job {i}", 4 + i % 6)
                                         for i, m in enumerate(models)))
        for events, _, _ in results:
            terminals = [e for e in events if e.type in ("done", "error")]
            ends.append(terminals[0].type if len(terminals) == 1 else f"{len(terminals)} terminals")
    return {"jobs": len(ends), "done": ends.count("done"), "failed_or_lost": len(ends) - ends.count("done"),
            "loads": host.ondemand.loads, "unloads": host.ondemand.unloads}


async def run() -> None:
    root = Path(tempfile.mkdtemp(prefix="mlxq-ondemand-"))
    try:
        small = ensure_model("small", root=root / "gen")
        copies = {n: shutil.copytree(small, root / n) for n in _NAMES}
        pinned = shutil.copytree(small, root / "pinned")  # a pinned model: what a worker holds anyway
        each = weights_bytes(str(small)) or 0
        with RedisServer() as redis:
            cfg = WorkerConfig(model=str(pinned), model_name="pinned",
                               loadable_models=",".join(f"{p}={n}" for n, p in copies.items()),
                               model_memory=3 * each + each // 2, model_idle_s=1.0, redis_url=redis.url,
                               capacity=8, poll_delay_s=0.25)
            running = await start_worker(cfg)
            try:
                async with Client(redis.url) as client:
                    cold = await _cold_start(client, running.host)
                    t0 = time.monotonic()
                    while running.host.ondemand.unloads < 1 and time.monotonic() - t0 < 30:
                        await asyncio.sleep(0.05)
                    first = running.host.services["a"]
                    memory = (first.before_load.active, first.after_unload.active)
                    mixed = await _mixed(client, running.host)
            finally:
                await running.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _report(cold, memory, mixed, each)


def _report(cold: dict[str, float], memory: tuple[int, int], mixed: dict[str, int], each: int) -> None:
    before, after = memory  # process-wide, the pinned model's weights in both
    drift = (after - before) / before if before else 0.0
    print(f"mlxq on-demand loading, {platform.node()} ({os.cpu_count()} CPUs, shared), small model "
          f"({each / (1 << 20):.1f} MiB of weights): one pinned, three loadable, a budget for the pinned one and 2")
    rows = [
        ("cold start: job start after submit", f"{cold['start_s']:.3f} s",
         f"<= load {cold['load_s']:.3f} s + 1 s", cold["start_s"] <= cold["load_s"] + 1),
        ("mixed load: jobs done / failed or lost", f"{mixed['done']} / {mixed['failed_or_lost']} of {mixed['jobs']}",
         "all done, 0 lost", mixed["failed_or_lost"] == 0),
        ("mixed load: loads / unloads", f"{mixed['loads']} / {mixed['unloads']}", "(figures)", True),
        ("memory: active before load -> after unload", f"{before / (1 << 20):.2f} -> {after / (1 << 20):.2f} MiB "
         f"({drift:+.2%}, {after - before:+d} B)", "within 5 %", abs(drift) <= 0.05),
    ]
    width = max(len(r[0]) for r in rows)
    for what, got, target, met in rows:
        print(f"  {what.ljust(width)}  {got:<40} target {target:<22} {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    asyncio.run(run())
