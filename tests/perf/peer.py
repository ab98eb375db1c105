"""``mlx_lm.server`` as a peer path: mlx-lm's own HTTP server, batching with the same ``BatchGenerator``, on the
same model and prompts, its runs alternated with the queue's.

It runs in a child process with the worker's batch settings (``--decode-concurrency`` the capacity,
``--prompt-concurrency`` the prefill batch) and the worker's BLAS threads, its prompt cache off (the bench's
prompts repeat from run to run; the queue caches only system prompts, which they have none of). Its HTTP/1.0
server takes one request per connection, and its listen backlog of 5 drops the connections of a burst beyond
it for a second (a retransmitted SYN): raised to 128 here, so its runs show what its schedule allows.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.bench.http import SseClient
from mlxq.worker.tools.bench.runs import TIMEOUT_S, Run

__all__ = ["ServerPath"]

_BACKLOG = 128
_READY_S = 120.0
_LAUNCH = ("import sys, http.server; http.server.ThreadingHTTPServer.request_queue_size = {backlog}; "
           "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()")


class ServerPath:
    """One ``mlx_lm.server`` child process serving ``model``; :meth:`run` streams a burst of completions."""

    def __init__(self, model: str, capacity: int, env: dict[str, str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        prefill = min(WorkerConfig().prefill_batch_size, capacity)
        argv = [sys.executable, "-c", _LAUNCH.format(backlog=_BACKLOG), "--model", model, "--port", str(self.port),
                "--decode-concurrency", str(capacity), "--prompt-concurrency", str(prefill),
                "--prefill-step-size", str(WorkerConfig().prefill_step_size), "--prompt-cache-size", "0"]
        self.model = model
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {self.proc.returncode} at start-up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"mlx_lm.server did not answer within {_READY_S:.0f} s")

    async def run(self, prompts: list[str], max_tokens: int) -> Run:
        """Every prompt at once, each a streamed greedy completion on a connection of its own; first request ->
        last end, and each request's time to its first text."""
        client = SseClient("127.0.0.1", self.port)
        t0 = time.perf_counter()
        try:
            traces = await asyncio.wait_for(asyncio.gather(*(self._one(client, p, max_tokens) for p in prompts)),
                                            TIMEOUT_S)
        finally:
            await client.aclose()
        end = max(e for _, e, _ in traces)
        return Run(sum(n for _, _, n in traces), end - t0, [(first - t0) * 1000 for first, _, _ in traces])

    async def _one(self, client: SseClient, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        """(first text, end, tokens) of one request."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        first: float | None = None
        tokens = 0
        async for data in client.events("/v1/completions", body):
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
        end = time.perf_counter()
        return (first or end), end, tokens

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
