"""``python3 -m tests.perf.responses``: the Responses API and webhooks against issue 49's targets, in one run on one
machine: a Redis, one worker on a generated model, one gateway (webhooks to a receiver in this process).

- **streaming**: N concurrent streamed requests, chat completions and Responses taking turns run by run (the
  same greedy prompts and max tokens): tok/s (every job's tokens ÷ the burst's wall time) and TTFT p50 (request
  sent → first text delta). Targets: Responses ÷ chat ≥ 0.95 (median of each pair's ratio); TTFT p50 within 5 ms
  (median of each pair's difference).
- **background create**: while the worker's batch is full of long streamed jobs, background creates one after
  another; each POST's latency. Target: p99 ≤ 20 ms.
- **webhooks**: background responses created at ``--rate`` a second (default 100) for ``--seconds``; for each,
  its job's end (the kept result's finish time, written with its terminal event) → its webhook's arrival at the
  receiver. Target: p99 ≤ 1 s.

Writes ``responses.json`` into ``--out`` and prints the table. The machine may be shared with other work: the
figures are what this run saw.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlxq.api.client import Client
from mlxq.api.gateway.response_events import TEXT_DELTA
from mlxq.worker.tools.bench.runs import percentile, prompt_batch, say
from mlxq.worker.tools.process import GatewayProcess, WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

SECRET = "whsec_" + base64.b64encode(b"mlxq-perf-responses-secret-0123").decode()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.responses", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf-out")
    p.add_argument("--size", default="tiny", help="generated model size (tiny, small)")
    p.add_argument("--n", type=int, default=16, help="concurrent streams per burst (and the batch capacity)")
    p.add_argument("--runs", type=int, default=49, help="measured runs per path, alternated (a burst's TTFT p50 "
                   "varies by ±30 ms run to run: the median of 25 pairs still moves by ±3 ms between runs)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--creates", type=int, default=200, help="background creates timed while the batch is full")
    p.add_argument("--rate", type=float, default=100.0, help="background responses (ends) a second")
    p.add_argument("--seconds", type=float, default=10.0, help="how long the webhook phase sends them")
    p.add_argument("--phases", default="streaming,create,webhooks", help="comma-separated, of the three")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(args.size))
    with Receiver() as receiver, RedisServer() as redis, contextlib.ExitStack() as stack:
        prefix = "mlxq-perf-responses"
        worker = WorkerProcess({"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": args.size, "MLXQ_REDIS_URL": redis.url,
                                "MLXQ_PREFIX": prefix, "MLXQ_BATCH_CAPACITY": str(max(args.n, 32)),
                                "OPENBLAS_NUM_THREADS": "1"}, out / "logs" / "responses-worker.log").start()
        stack.callback(worker.stop)
        worker.wait_ready()
        gateway = GatewayProcess({"MLXQ_REDIS_URL": redis.url, "MLXQ_PREFIX": prefix, "MLXQ_MAX_QUEUED": "0",
                                  "MLXQ_WEBHOOK_URL": receiver.url, "MLXQ_WEBHOOK_SECRET": SECRET},
                                 out / "logs" / "responses-gateway.log").start()
        stack.callback(gateway.stop)
        gateway.wait_ready()
        load_before = os.getloadavg()
        report = asyncio.run(_measure(args, gateway.url, redis.url, prefix, receiver))
    load = {"before": load_before, "after": os.getloadavg(), "cores": os.cpu_count()}
    (out / "responses.json").write_text(json.dumps({"args": vars(args), "load": load, **report}, indent=1))
    print(_table(report))
    print(f"load average (1, 5, 15 min) before {load_before}, after {load['after']}, on {load['cores']} cores")
    return 0


async def _measure(args: argparse.Namespace, url: str, redis_url: str, prefix: str, receiver: Receiver
                   ) -> dict[str, Any]:
    room = 2 * max(args.n, 32) + 64  # the fillers' streams, and the creates beside them, each on a connection
    # An idle connection is dropped well before the gateway's keep-alive timeout (uvicorn's 5 s, httpx's default
    # expiry too): one reused as the server closes it fails the request (httpx.ReadError on a loaded machine).
    limits = httpx.Limits(max_connections=room, max_keepalive_connections=room, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http, \
            Client(redis_url, prefix=prefix) as client:
        phases = set(args.phases.split(","))
        streaming = await _streaming(args, http, client) if "streaming" in phases else None
        creates = await _creates(args, http) if "create" in phases else None
        hooks = await _webhooks(args, http, client, receiver) if "webhooks" in phases else None
    return {"streaming": streaming, "background_create": creates, "webhooks": hooks}


# --- streaming ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Burst:
    tokens: int = 0
    seconds: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def _one_stream(http: httpx.AsyncClient, client: Client, path: str, body: dict[str, Any]
                      ) -> tuple[float, int]:
    """One streamed request: its TTFT (ms to the first text delta) and its job's generated tokens."""
    t0 = time.perf_counter()
    ttft = 0.0
    async with http.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        rid = resp.headers["x-mlxq-job-id"]
        async for line in resp.aiter_lines():
            if not ttft and _has_text(line):
                ttft = (time.perf_counter() - t0) * 1000
    result = await client.result(rid, timeout=60)
    return ttft, result.usage.completion_tokens


def _has_text(line: str) -> bool:
    """Whether an SSE line carries text. Only a line that can is decoded: this client's own JSON parsing of the
    events before (a response's created and in_progress carry the whole response object) is not the gateway's."""
    if not line.startswith("data: {"):
        return False
    if line.startswith('data: {"type":"response.') and not line.startswith(f'data: {{"type":"{TEXT_DELTA}"'):
        return False
    data = json.loads(line[6:])
    if data.get("type") == TEXT_DELTA:
        return bool(data.get("delta"))
    choices = data.get("choices") or []
    return bool(choices and (choices[0].get("delta") or {}).get("content"))


async def _burst(args: argparse.Namespace, http: httpx.AsyncClient, client: Client, kind: str, max_tokens: int
                 ) -> Burst:
    prompts = prompt_batch(args.n)
    if kind == "chat":
        bodies = [("/v1/chat/completions", {"model": args.size, "stream": True, "max_tokens": max_tokens,
                                            "messages": [{"role": "user", "content": p}]}) for p in prompts]
    else:
        bodies = [("/v1/responses", {"model": args.size, "stream": True, "max_output_tokens": max_tokens,
                                     "input": p}) for p in prompts]
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_one_stream(http, client, path, body) for path, body in bodies))
    return Burst(sum(n for _, n in got), time.perf_counter() - t0, [t for t, _ in got])


async def _streaming(args: argparse.Namespace, http: httpx.AsyncClient, client: Client) -> dict[str, Any]:
    runs: dict[str, list[Burst]] = {"chat": [], "responses": []}
    for k in range(args.runs + 1):  # the first round warms both up
        for kind in (("chat", "responses") if k % 2 else ("responses", "chat")):
            await asyncio.sleep(0.3)
            burst = await _burst(args, http, client, kind, args.max_tokens if k else 8)
            if k:
                runs[kind].append(burst)
                say(f"run {k} {kind:9} {burst.tok_s:8.1f} tok/s, TTFT p50 {percentile(burst.ttft_ms, 50):6.1f} ms")
    ratios = [r.tok_s / c.tok_s for c, r in zip(runs["chat"], runs["responses"], strict=True) if c.tok_s]
    diffs = [percentile(r.ttft_ms, 50) - percentile(c.ttft_ms, 50)
             for c, r in zip(runs["chat"], runs["responses"], strict=True)]
    return {kind: {"tok_s": [round(b.tok_s, 1) for b in bs], "ttft_p50_ms": [round(percentile(b.ttft_ms, 50), 1)
                                                                             for b in bs]}
            for kind, bs in runs.items()} | {"ratio_median": percentile(ratios, 50),
                                             "ttft_diff_ms_median": percentile(diffs, 50)}


# --- background creates while the fleet is busy ----------------------------------------------------------------
async def _creates(args: argparse.Namespace, http: httpx.AsyncClient) -> dict[str, Any]:
    busy_body = {"model": args.size, "stream": True, "max_tokens": 400, "messages": [{"role": "user",
                                                                                       "content": "busy"}]}

    async def busy() -> None:
        async with http.stream("POST", "/v1/chat/completions", json=busy_body) as resp:
            async for _ in resp.aiter_raw():  # read, not parsed: the load is the gateway's, not this client's
                pass

    fillers = [asyncio.ensure_future(busy()) for _ in range(max(args.n, 32))]
    await asyncio.sleep(1.0)  # their jobs admitted: the batch is full
    for i in range(5):  # not timed: the first background creates of the gateway process (cold paths)
        (await http.post("/v1/responses", json={"model": args.size, "input": f"warm {i}", "max_output_tokens": 4,
                                                "background": True})).raise_for_status()
    latencies = []
    try:
        for i in range(args.creates):
            t0 = time.perf_counter()
            resp = await http.post("/v1/responses", json={"model": args.size, "input": f"bg {i}",
                                                          "max_output_tokens": 4, "background": True})
            latencies.append((time.perf_counter() - t0) * 1000)
            resp.raise_for_status()
    finally:
        for f in fillers:
            f.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
    say(f"background create while busy: p50 {percentile(latencies, 50):.1f} ms, p99 {percentile(latencies, 99):.1f} ms")
    return {"n": len(latencies), "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
            "max_ms": max(latencies), "latencies_ms": [round(v, 1) for v in latencies]}


# --- webhooks at a rate of ends --------------------------------------------------------------------------------
async def _webhooks(args: argparse.Namespace, http: httpx.AsyncClient, client: Client, receiver: Receiver
                    ) -> dict[str, Any]:
    await asyncio.sleep(2.0)
    receiver.clear()
    total = int(args.rate * args.seconds)
    created: list[str] = []
    sem = asyncio.Semaphore(64)

    async def create(i: int) -> None:
        async with sem:
            resp = await http.post("/v1/responses", json={"model": args.size, "input": f"w{i}",
                                                          "max_output_tokens": 2, "background": True})
            resp.raise_for_status()
            created.append(resp.json()["id"])

    t0 = time.perf_counter()
    tasks = []
    for i in range(total):  # paced: one every 1/rate s
        await asyncio.sleep(max(0.0, t0 + i / args.rate - time.perf_counter()))
        tasks.append(asyncio.ensure_future(create(i)))
    await asyncio.gather(*tasks)
    sent_s = time.perf_counter() - t0
    for _ in range(600):
        if len({rid for rid, _ in receiver.got}) >= len(created):
            break
        await asyncio.sleep(0.1)
    arrivals: dict[str, float] = {}
    for rid, at in receiver.got:  # the first delivery of each (a retry would come later)
        arrivals.setdefault(rid, at)
    delays = []
    for rid in created:
        kept = await client.kept(rid.removeprefix("resp_"))
        if kept is not None and rid in arrivals:
            delays.append((arrivals[rid] - kept.finish_ms / 1000) * 1000)
    finishes = sorted(k.finish_ms for k in [await client.kept(r.removeprefix("resp_")) for r in created] if k)
    ends_rate = (len(finishes) - 1) / ((finishes[-1] - finishes[0]) / 1000) if len(finishes) > 1 else 0.0
    say(f"webhooks: {len(delays)} of {len(created)} landed; ends {ends_rate:.0f}/s; end → arrival p50 "
        f"{percentile(delays, 50):.0f} ms, p99 {percentile(delays, 99):.0f} ms")
    return {"created": len(created), "landed": len(delays), "create_s": sent_s, "ends_per_s": ends_rate,
            "p50_ms": percentile(delays, 50), "p99_ms": percentile(delays, 99), "max_ms": max(delays or [0.0]),
            "delays_ms": [round(v) for v in delays]}  # in the order they were created


_RECEIVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
out = open(sys.argv[1], "a", buffering=1)
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as a real receiver's server keeps them
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        out.write(f"{json.loads(body)['data']['id']} {time.time():.6f}\\n")
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
# socketserver's listen backlog is 5: a burst of connections past it loses SYNs, retried by the kernel a second
# later, which would be timed as the gateway's delay (a real receiver's server listens with hundreds).
ThreadingHTTPServer.request_queue_size = 1024
server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Receiver:
    """A webhook endpoint on loopback, in a process of its own (so the benchmark's own work does not delay it):
    each event's object id and arrival time (epoch s), read from the file it appends to."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="mlxq-hooks-")) / "arrivals.txt"
        self.proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(self.path)], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/hook"

    @property
    def got(self) -> list[tuple[str, float]]:
        if not self.path.exists():
            return []
        rows = [line.split() for line in self.path.read_text().splitlines()]
        return [(rid, float(at)) for rid, at in rows if rid]

    def clear(self) -> None:
        self.path.write_text("")

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _table(report: dict[str, Any]) -> str:
    s, c, w = report["streaming"], report["background_create"], report["webhooks"]
    rows = []
    if s is not None:
        rows += [("Responses ÷ chat completions, streamed tok/s (median of pairs)", f"{s['ratio_median']:.3f}",
                  "≥ 0.95", s["ratio_median"] >= 0.95),
                 ("TTFT p50, Responses - chat (median of pairs)", f"{s['ttft_diff_ms_median']:+.1f} ms", "≤ 5 ms",
                  s["ttft_diff_ms_median"] <= 5.0)]
    if c is not None:
        rows.append(("background create while busy, p99", f"{c['p99_ms']:.1f} ms", "≤ 20 ms", c["p99_ms"] <= 20.0))
    if w is not None:
        rows.append((f"webhook end → arrival p99 at {w['ends_per_s']:.0f} ends/s", f"{w['p99_ms']:.0f} ms",
                     "≤ 1000 ms", w["p99_ms"] <= 1000.0 and w["landed"] == w["created"]))
    lines = ["| target | measured | goal | |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {goal} | {'PASS' if ok else 'MISS'} |" for name, value, goal, ok in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
