"""The paths the bench drives, each one burst of N requests at a time: raw mlx-lm in this process, the queue
(client -> Redis -> a worker process -> the client) and the HTTP gateway in front of the same worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.worker.config import WorkerConfig

from ..process import WorkerProcess
from .http import SseClient
from .runs import SETTLE_S, TIMEOUT_S, Run

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxq.engine.mlx.loader import LoadedModel

__all__ = ["RawPath", "Trace", "frozen", "raw_run", "run_gateway", "run_queue", "stream"]


class RawPath:
    """The raw path: mlx-lm's ``BatchGenerator`` on this process's own MLX thread, the model loaded once."""

    def __init__(self, model: str, capacity: int) -> None:
        from mlxq.engine.mlx.loader import load_model
        from mlxq.engine.mlx.thread import MLXThread

        self.thread = MLXThread(name="mlx-bench")
        self.loaded: LoadedModel = self.thread.submit(load_model, model).result()
        self.capacity = capacity

    async def run(self, prompts: list[str], max_tokens: int) -> Run:
        """Prompts tokenized as the worker does, then one :func:`raw_run` on the MLX thread."""
        fut = self.thread.submit(raw_run, self.loaded, self.encode(prompts), max_tokens, self.capacity,
                                 self.thread.stream)
        return await asyncio.wrap_future(fut)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt, as the worker encodes a raw prompt."""
        from mlxq.engine.core.prompt import encode_prompt

        return [encode_prompt(self.loaded.tokenizer, p, None) for p in prompts]

    def close(self) -> None:
        self.thread.shutdown()


def raw_run(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, capacity: int,
            stream: mx.Stream) -> Run:
    """Insert every prompt at once, step until all finish (on the MLX thread)."""
    from mlx_lm.generate import BatchGenerator

    defaults = WorkerConfig()  # the worker's prefill settings, so both paths batch alike
    gen = BatchGenerator(loaded.model, stop_tokens=[[t] for t in sorted(loaded.eos_token_ids)],
                         completion_batch_size=capacity,
                         prefill_batch_size=min(defaults.prefill_batch_size, capacity),
                         prefill_step_size=defaults.prefill_step_size, stream=stream)
    try:
        t0 = time.perf_counter()
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        first: dict[int, float] = {}
        live, tokens = set(uids), 0
        while live:
            _, generated = gen.next()
            now = time.perf_counter()
            for r in generated:
                first.setdefault(r.uid, now)
                tokens += r.finish_reason != "stop"  # an EOS token is not part of the completion
                if r.finish_reason is not None:
                    live.discard(r.uid)
        seconds = time.perf_counter() - t0
    finally:
        gen.close()
    return Run(tokens, seconds, [(first[u] - t0) * 1000 for u in uids])


@contextlib.contextmanager
def frozen(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the idle worker around a raw run: its polling must not tax the ceiling.

    Every run starts after the same idle pause, raw or queue: a machine runs a short burst measurably faster
    after a pause than right after another burst, OpenBLAS threads spin for a while after their last call, and
    the resumed worker first runs the timers that fell due while it was stopped.
    """
    worker.signal(signal.SIGSTOP)
    time.sleep(SETTLE_S)
    try:
        yield
    finally:
        worker.signal(signal.SIGCONT)
        time.sleep(SETTLE_S)


@dataclass(slots=True)
class Trace:
    """One request as its client saw it."""

    submitted: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    rid: str = ""  # its job's id


def _burst(t0: float, traces: list[Trace]) -> Run:
    end = max(t.ended or t0 for t in traces)
    return Run(sum(t.tokens for t in traces), end - t0, [((t.first_token or end) - t.submitted) * 1000 for t in traces],
               [t.rid for t in traces])


async def run_queue(client: Client, model: str, prompts: list[str], max_tokens: int) -> Run:
    """Submit every prompt at once and follow each job; first submit -> last terminal event."""
    t0 = time.perf_counter()
    return _burst(t0, list(await asyncio.gather(*(_follow(client, model, p, max_tokens) for p in prompts))))


async def _follow(client: Client, model: str, prompt: str, max_tokens: int) -> Trace:
    trace = Trace(time.perf_counter())
    async for ev in client.submit_and_follow(model=model, prompt=prompt, max_tokens=max_tokens, timeout=TIMEOUT_S):
        trace.rid = ev.id
        if ev.type == "token" and trace.first_token is None:
            trace.first_token = time.perf_counter()
        elif isinstance(ev, DoneEvent):
            trace.ended, trace.tokens = time.perf_counter(), ev.usage.completion_tokens
        elif isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
    return trace


async def run_gateway(http: SseClient, model: str, prompts: list[str], max_tokens: int) -> Run:
    """Every prompt at once through the gateway (``POST /v1/completions``, streamed); first request -> last end."""
    t0 = time.perf_counter()
    return _burst(t0, list(await asyncio.gather(*(stream(http, model, p, max_tokens) for p in prompts))))


async def stream(http: SseClient, model: str, prompt: str, max_tokens: int) -> Trace:
    """One greedy completion streamed through the gateway, read to its end."""
    trace = Trace(time.perf_counter())
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    # Read to the response's end, past [DONE] (the chunked body's last chunk follows it at once): a stream left
    # unfinished cannot hand its connection back, and each request would open a new one inside its TTFT.
    async for data in http.events("/v1/completions", body):
        if data == b"[DONE]":
            trace.ended = time.perf_counter()
            continue
        chunk = json.loads(data)
        trace.rid = trace.rid or chunk.get("id", "").partition("-")[2]  # "cmpl-<job id>"
        if "error" in chunk:
            raise RuntimeError(f"the gateway's stream failed: {chunk['error']}")
        if trace.first_token is None and chunk["choices"] and chunk["choices"][0]["text"]:
            trace.first_token = time.perf_counter()
        if chunk.get("usage"):
            trace.tokens = chunk["usage"]["completion_tokens"]
    trace.ended = trace.ended or time.perf_counter()
    return trace
