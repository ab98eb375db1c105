"""``mlxq demo``: the whole path on a fresh machine, with no Redis server and no model download.

Starts a private Redis (unless ``MLXQ_REDIS_URL`` is set), generates a tiny random-weight model, runs
``arq mlxq.worker.Settings`` in a child process, then streams one job alone and N concurrent jobs through the
queue, and cancels one mid-decode. Weights are random, so the text is gibberish; the timings are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.api.settings import parse_redis_url

from .process import GatewayProcess, WorkerProcess
from .redis_server import NoRedisServer, RedisServer
from .tinymodel import ensure_model  # imports MLX: a producer-only install fails here, before anything starts

__all__ = ["EXIT_NO_REDIS", "EXIT_PORT_TAKEN", "run_demo"]

EXIT_NO_REDIS = 2  # no redis-server to embed (as a missing extra: something to install)
EXIT_PORT_TAKEN = 2  # the gateway's port is in use (a setting to change)
# The tool the gateway's tools curl line offers a tiny-tools demo, whose random model calls it with noise: a
# bounded string, which it would otherwise write on to the end of its context.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}

PROMPTS = [
    "Hello world number {i} the quick brown fox",
    "Once upon a time, in a land far away, job {i}",
    "{i}",
    "The queue folds every job into one batch: job {i} says",
]


@dataclass(slots=True)
class _Track:
    """One demo job as the terminal shows it."""

    rid: str
    text: str = ""
    status: str = "queued"
    tokens: int = 0
    ttft_ms: float | None = None
    submitted: float = field(default_factory=time.perf_counter)


def _printable(text: str) -> str:
    # Random weights emit control bytes; keep the terminal sane.
    return "".join(ch if ch.isprintable() else "·" for ch in text)


def run_demo(jobs: int = 8, max_tokens: int = 64, size: str = "tiny", gateway_port: int | None = None) -> int:
    """Run the demo; returns the exit status. ``gateway_port``: then serve the gateway there until Ctrl-C. It
    leaves nothing behind but the generated model (cached for the next run), and the logs only if something
    failed."""
    with _sigterm_as_interrupt():
        return _demo(jobs, max_tokens, size, gateway_port)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM (``kill``, a supervisor) ends the demo as Ctrl-C does, so its Redis, worker and gateway stop
    with it instead of living on as orphans; and so does SIGINT even where it was inherited ignored (a shell
    script's background job)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, signal.default_int_handler)  # raises KeyboardInterrupt
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo(jobs: int, max_tokens: int, size: str, gateway_port: int | None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its no-PyTorch notice is not ours to print
    if gateway_port and not _port_free(gateway_port):  # before anything starts: nothing to stop or leave behind
        _say(f"mlxq: port {gateway_port} is in use; pick another with `mlxq demo --gateway --port N` "
             "(--port 0: any free one)")
        return EXIT_PORT_TAKEN
    url = os.environ.get("MLXQ_REDIS_URL")
    if url:  # a bad one is the CLI's ConfigError (exit 2), before anything starts
        url = parse_redis_url("MLXQ_REDIS_URL", url)
    try:
        server = None if url else RedisServer().start()
    except NoRedisServer as exc:
        _say(f"mlxq: the demo embeds a Redis server, but there is {exc}; or set MLXQ_REDIS_URL to a Redis you run")
        return EXIT_NO_REDIS
    workdir = Path(tempfile.mkdtemp(prefix="mlxq-demo-"))
    status = 1
    try:
        status = _run(url or (server.url if server else ""), bool(server), workdir, jobs, max_tokens, size,
                      gateway_port)
        return status
    finally:
        if server is not None:
            server.close()
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            _say(f"the worker's log is kept in {workdir}")


def _port_free(port: int) -> bool:
    """Whether the gateway can listen on ``port`` of the loopback address (as uvicorn binds: SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run(url: str, embedded: bool, workdir: Path, jobs: int, max_tokens: int, size: str,
         gateway_port: int | None) -> int:
    prefix = f"mlxq-demo-{uuid.uuid4().hex[:6]}"
    _say(f"redis: {url} ({'embedded redis-server' if embedded else 'MLXQ_REDIS_URL'}); to watch it from another "
         f"shell: MLXQ_REDIS_URL={url} MLXQ_PREFIX={prefix} mlxq status")
    t0 = time.perf_counter()
    model = ensure_model(size)
    _say(f"model: {size} random-weight model at {model} ({time.perf_counter() - t0:.1f}s)")
    env = {"MLXQ_MODEL": str(model), "MLXQ_MODEL_NAME": size, "MLXQ_REDIS_URL": url,
           "MLXQ_PREFIX": prefix, "MLXQ_BATCH_CAPACITY": str(max(jobs, 1))}
    worker = WorkerProcess(env, workdir / "worker.log").start()
    status = 1
    try:
        t0 = time.perf_counter()
        worker.wait_ready()
        _say(f"worker: `arq mlxq.worker.Settings` ready in {time.perf_counter() - t0:.1f}s")
        status = asyncio.run(_demo_jobs(url, prefix, size, jobs, max_tokens))
        if gateway_port is not None and status == 0:
            status = _serve_gateway(url, prefix, size, workdir, gateway_port)
    finally:
        code = worker.stop()
        _say(f"worker stopped (exit {code})")
    return status or int(code != 0)


async def _demo_jobs(url: str, prefix: str, model: str, jobs: int, max_tokens: int) -> int:
    async with Client(url, prefix=prefix) as client:
        await client.generate(model=model, prompt="warm up", max_tokens=4, timeout=120)
        _say("\n== 1 job alone, streamed ==")
        one = await _run_batch(client, model, 1, max_tokens, live=True)
        _say(f"\n== {jobs} concurrent jobs in one continuous batch ==")
        many = await _run_batch(client, model, jobs, max_tokens, live=False)
        _say("\n== cancel one of 2 jobs mid-decode ==")
        await _cancel_demo(client, model, max_tokens)
        _say(f"\nsummary: 1 job {one:.1f} tok/s; {jobs} concurrent jobs {many:.1f} tok/s aggregate "
             f"({many / one if one else 0:.1f}x)")
    return 0


async def _run_batch(client: Client, model: str, n: int, max_tokens: int, live: bool) -> float:
    """Submit n jobs at once, follow them all; returns aggregate completion tok/s."""
    t0 = time.perf_counter()
    rids = await asyncio.gather(*(
        client.submit(model=model, prompt=PROMPTS[i % len(PROMPTS)].format(i=i), max_tokens=max_tokens)
        for i in range(n)
    ))
    tracks = [_Track(rid) for rid in rids]
    await asyncio.gather(*(_follow(client, t, live) for t in tracks))
    elapsed = time.perf_counter() - t0
    if not live:
        for i, t in enumerate(tracks):
            print(f"job {i}: {_printable(t.text)[:60]!s:60} [{t.status}, {t.tokens} tok, ttft {t.ttft_ms:.0f} ms]")
    total = sum(t.tokens for t in tracks)
    _say(f"{n} job(s): {total} tokens in {elapsed * 1000:.0f} ms -> {total / elapsed:.1f} tok/s")
    return total / elapsed


async def _follow(client: Client, track: _Track, live: bool) -> None:
    async for ev in client.events(track.rid, timeout=300):
        if ev.type == "token":
            if track.ttft_ms is None:
                track.ttft_ms = (time.perf_counter() - track.submitted) * 1000
            track.text += ev.text
            if live:
                sys.stdout.write(_printable(ev.text))
                sys.stdout.flush()
        elif isinstance(ev, DoneEvent):
            track.status, track.tokens = ev.finish_reason.value, ev.usage.completion_tokens
        elif isinstance(ev, ErrorEvent):
            track.status = f"error {ev.code.value}: {ev.message}"
    if live:
        print()
        _say(f"[{track.status}, {track.tokens} tok, ttft {track.ttft_ms or 0:.0f} ms]")


async def _cancel_demo(client: Client, model: str, max_tokens: int) -> None:
    long_tokens = max(max_tokens * 4, 256)
    keep = await client.submit(model=model, prompt="this job runs to the end", max_tokens=max_tokens)
    victim = await client.submit(model=model, prompt="this job gets cancelled", max_tokens=long_tokens)
    async for ev in client.events(victim, timeout=120):
        if ev.type == "token" and ev.index >= 8:
            t0 = time.perf_counter()
            await client.cancel(victim)
            break
    result = await client.result(victim, timeout=120)
    waited = (time.perf_counter() - t0) * 1000
    kept = await client.result(keep, timeout=120)
    _say(f"cancelled job: {result.finish_reason.value} after {result.usage.completion_tokens}/{long_tokens} "
         f"tokens, terminal event {waited:.0f} ms after the cancel")
    _say(f"other job: {kept.finish_reason.value}, {kept.usage.completion_tokens} tokens")


def _serve_gateway(url: str, prefix: str, model: str, workdir: Path, port: int) -> int:
    """``mlxq gateway`` in front of the demo's worker, until Ctrl-C; prints the ``curl`` lines to try it."""
    gateway = GatewayProcess({"MLXQ_REDIS_URL": url, "MLXQ_PREFIX": prefix}, workdir / "gateway.log", port or None)
    gateway.start()
    try:
        gateway.wait_ready()
        _say(f"\n== the HTTP gateway at {gateway.url} (OpenAI and Anthropic APIs; log: {gateway.log_path}) ==")
        chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32, "stream": True}
        message = {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello"}]}
        print(f"curl -N {gateway.url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{json.dumps(chat)}'", flush=True)
        print(f"curl {gateway.url}/v1/messages -H 'Content-Type: application/json' -d '{json.dumps(message)}'",
              flush=True)
        if model == "tiny-tools":
            tools = {"model": model, "messages": [{"role": "user", "content": "The weather in Paris?"}],
                     "tools": [WEATHER_TOOL], "tool_choice": "required"}  # no max_tokens: up to the context
            print(f"curl {gateway.url}/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{json.dumps(tools)}'", flush=True)
        _say("serving until Ctrl-C (or SIGTERM)")
        assert gateway.proc is not None
        gateway.proc.wait()
        _say(f"the gateway exited ({gateway.proc.returncode}); log:\n{gateway.log_path.read_text(errors='replace')}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        gateway.stop()


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
