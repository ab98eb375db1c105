"""``python3 -m tests.perf.batch``: issue 50's Batch API target, and the Redis memory a batch costs.

- **throughput**: a chat batch of ``--lines`` lines (1,000) alone, run through the queue (a JSONL file stored in
  Redis, a feeder in this process keeping ``--window`` jobs in the queue, a worker process of capacity
  ``--capacity``), against raw mlx-lm ``BatchGenerator`` on the same prompts (rendered with the chat template, as
  the worker renders them), every line inserted at once (the ceiling). The batch's lines run in the bulk band, as
  every batch's do (alone here, so on the whole engine). Runs alternate raw, batch, raw, batch; the
  idle worker is stopped during raw runs. Batch tok/s is create → completed (validation, feeding, the output
  file written) over the completion tokens its usage counts. Target: batch ÷ raw ≥ 0.95. With ``--queue-path``,
  after each batch run the same requests submitted at once by a ``Client`` (no batch, no feeder) in each band,
  interactive and bulk (which goes first alternates between pairs): what the feeder costs, and what the bulk band
  costs a batch alone (bulk ÷ interactive).
- **memory**: ``MEMORY USAGE`` on a real Redis of each key a batch of ``N`` lines holds (the input file's chunks
  and record, the batch record, the per-line results while it runs, the output file once it ended), for realistic
  lines (a chat request; a chat.completion answer of ~32 tokens), no model needed.

Writes ``batch.json`` and ``batch.md`` into ``--out``; ``--quick`` is a smoke run (the tiny model, 64 lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlxq.api.batches import BatchStore, output_line
from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.feeder import BatchFeeder, FeederSettings
from mlxq.api.files import FileStore
from mlxq.api.gateway.batch_lines import BatchLines
from mlxq.api.gateway.config import GatewayConfig
from mlxq.api.protocol.keys import Keys
from mlxq.worker.tools.bench.paths import RawPath, frozen, raw_run
from mlxq.worker.tools.bench.preload import reexec_with_openblas
from mlxq.worker.tools.bench.runs import Run, prompt_batch, say
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

from .paths import cpu_seconds

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.95


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.batch", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf-out")
    p.add_argument("--quick", action="store_true", help="a smoke run: the tiny model, 64 lines, one pair")
    p.add_argument("--size", default=None, help="generated model size (default: small; tiny with --quick)")
    p.add_argument("--lines", type=int, default=None, help="lines of the batch (default: 1000; 64 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="per line (default: 32; 8 with --quick)")
    p.add_argument("--capacity", type=int, default=32, help="the worker's batch capacity (and raw's)")
    p.add_argument("--window", type=int, default=256, help="the batch's jobs in the queue at once")
    p.add_argument("--runs", type=int, default=None, help="raw/batch pairs (default: 2; 1 with --quick)")
    p.add_argument("--memory-lines", default="1000,10000", help="batch sizes of the memory phase")
    p.add_argument("--phases", default="memory,throughput")
    p.add_argument("--queue-path", action="store_true", help="also the same requests submitted at once by a "
                   "Client (no batch), interactive and in the bulk band, after each batch run: what the feeder "
                   "costs, and what the band costs")
    p.add_argument("--no-reexec", action="store_true", help="run with whatever BLAS this process has")
    return p


@dataclass(frozen=True, slots=True)
class Pair:
    raw_tok_s: float
    batch_tok_s: float
    raw_tokens: int
    batch_tokens: int
    batch_seconds: float
    queue_tok_s: float = 0.0  # the same requests submitted at once by a Client, no batch: the feeder's share
    queue_bulk_tok_s: float = 0.0  # the same again in the bulk band: the band's share
    feeder_cpu_s: float = 0.0  # this process's CPU over the batch run (the feeder, its client)
    worker_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.batch_tok_s / self.raw_tok_s if self.raw_tok_s else 0.0

    @property
    def band_ratio(self) -> float:
        """The bulk band's tok/s over the interactive one's, the same requests by a Client (0: not measured)."""
        return self.queue_bulk_tok_s / self.queue_tok_s if self.queue_tok_s else 0.0


async def _queue_run(client: Client, prompts: list[str], max_tokens: int, bulk: bool = False) -> float:
    """Every line's request submitted at once by the client (in the bulk band: ``bulk``), each followed to its
    end: tok/s."""
    async def one(prompt: str) -> int:
        r = await client.generate(model="bench", messages=messages(prompt), max_tokens=max_tokens, temperature=0,
                                  reasoning="split", bulk=bulk, timeout=3600)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - t0)


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def lines_of(prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "bench", "messages": messages(p), "max_tokens": max_tokens, "temperature": 0}}
            for i, p in enumerate(prompts)]


# --- throughput --------------------------------------------------------------------------------------------------
async def _batch_run(client: Client, store: BatchStore, lines: list[dict[str, Any]]) -> tuple[int, float]:
    t0 = time.perf_counter()
    b = await client.create_batch(lines, endpoint="/v1/chat/completions")
    while (b := await store.get(b["id"], "default"))["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.05)
    seconds = time.perf_counter() - t0
    if b["status"] != "completed" or b["request_counts"]["failed"]:
        raise RuntimeError(f"the batch ended {b['status']} with {b['request_counts']}")
    return int(b["usage"]["output_tokens"]), seconds


def throughput(args: argparse.Namespace, model: str, out: Path) -> list[Pair]:
    prompts = prompt_batch(args.lines)
    with RedisServer() as redis:
        prefix = f"mlxq-batch-{os.getpid()}"
        worker = WorkerProcess({"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": "bench", "MLXQ_REDIS_URL": redis.url,
                                "MLXQ_PREFIX": prefix, "MLXQ_BATCH_CAPACITY": str(args.capacity)},
                               out / "logs" / "batch-worker.log").start()
        raw = RawPath(model, args.capacity)
        try:
            worker.wait_ready()
            encoded = [raw.loaded.tokenizer.apply_chat_template(messages(p), add_generation_prompt=True)
                       for p in prompts]
            pids = (worker.proc.pid if worker.proc else None, redis.proc.pid if redis.proc else None)
            return asyncio.run(_pairs(args, redis.url, prefix, raw, worker, pids, encoded, prompts))
        finally:
            raw.close()
            worker.stop()


async def _pairs(args: argparse.Namespace, url: str, prefix: str, raw: RawPath, worker: WorkerProcess,
                 pids: tuple[int | None, int | None], encoded: list[list[int]], prompts: list[str]
                 ) -> list[Pair]:
    lines = lines_of(prompts, args.max_tokens)
    config = ClientConfig(redis_url=url, prefix=prefix)
    pairs = []
    async with Client(config=config) as client:
        store = client.batch_store()
        feeder = BatchFeeder(client, store, BatchLines(GatewayConfig(client=config)),
                             FeederSettings(window=args.window, poll_s=0.05))
        feeder.start()
        try:
            await _batch_run(client, store, lines[: min(len(lines), args.capacity)])  # warm-up
            for i in range(args.runs):
                with frozen(worker):
                    fut = raw.thread.submit(raw_run, raw.loaded, encoded, args.max_tokens, args.capacity,
                                            raw.thread.stream)
                    r: Run = await asyncio.wrap_future(fut)
                cpu0 = (time.process_time(), cpu_seconds(pids[0]), cpu_seconds(pids[1]))
                tokens, seconds = await _batch_run(client, store, lines)
                cpu = (time.process_time() - cpu0[0], cpu_seconds(pids[0]) - cpu0[1], cpu_seconds(pids[1]) - cpu0[2])
                queue = await _bands(client, prompts, args.max_tokens, i) if args.queue_path else (0.0, 0.0)
                pair = Pair(r.tok_s, tokens / seconds, r.tokens, tokens, seconds, *queue, *cpu)
                say(f"pair {i + 1}: raw {pair.raw_tok_s:.1f} tok/s ({r.tokens} tokens), batch "
                    f"{pair.batch_tok_s:.1f} tok/s ({tokens} tokens in {seconds:.1f} s): {pair.ratio:.3f}; CPU s "
                    f"feeder {cpu[0]:.1f}, worker {cpu[1]:.1f}, redis {cpu[2]:.1f}; queue alone {queue[0]:.1f} "
                    f"tok/s, in the bulk band {queue[1]:.1f} tok/s: {pair.band_ratio:.3f}")
                pairs.append(pair)
        finally:
            await feeder.aclose()
    return pairs


async def _bands(client: Client, prompts: list[str], max_tokens: int, pair: int) -> tuple[float, float]:
    """The same requests by a Client, interactive then bulk (bulk first in every other pair, so a drift of the
    machine's load falls on both alike): each one's tok/s."""
    got = {}
    for bulk in ((False, True) if pair % 2 == 0 else (True, False)):
        got[bulk] = await _queue_run(client, prompts, max_tokens, bulk)
    return got[False], got[True]


# --- memory ---------------------------------------------------------------------------------------------------------
async def memory(sizes: list[int]) -> list[dict[str, Any]]:
    """Each key's MEMORY USAGE for a batch of each size, at its three stages."""
    from redis.asyncio import Redis

    out = []
    with RedisServer() as server:
        redis = Redis.from_url(server.url)
        try:
            for n in sizes:
                out.append(await _memory_of(redis, n))
                await redis.flushdb()
        finally:
            await redis.aclose()
    return out


async def _usage(redis: Any, *keys: str) -> int:
    return sum([int(await redis.memory_usage(k, samples=0) or 0) for k in keys])


async def _memory_of(redis: Any, n: int) -> dict[str, Any]:
    from mlxq.api.batches import RECORD

    keys = Keys("m")
    store = BatchStore(redis, keys, FileStore(redis, keys))
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines_of(prompt_batch(n), 32))
    file = await store.files.create(data, "in.jsonl", "batch", "default")
    b = await store.create(file["id"], "/v1/chat/completions", "default")
    bid = b["id"]
    text = " word" * 32
    for i in range(n):  # the per-line records, as the feeder writes them (a chat.completion of 32 tokens)
        body = {"id": f"chatcmpl-{bid}.L{i}", "object": "chat.completion", "created": 1_800_000_000, "model": "bench",
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 40, "completion_tokens": 32, "total_tokens": 72}}
        await RECORD.run(redis, {"results_key": keys.batch_results(bid), "inflight_key": keys.batch_inflight(bid),
                                 "batch_key": keys.batch(bid)},
                         {"line": i, "kind": "o", "entry": output_line(bid, i, f"l{i}", f"{bid}.L{i}", body),
                          "input_tokens": 40, "output_tokens": 32})
    results = await _usage(redis, keys.batch_results(bid))
    entries = [e async for e in _hscan(redis, keys.batch_results(bid))]
    output = b"".join(e[1:] + b"\n" for e in entries)
    await store.files.create(output, "out.jsonl", "batch_output", "default", file_id="file-out")
    row = {"lines": n, "input_file_bytes": len(data),
           "input_file": await _usage(redis, keys.file(file["id"]), keys.file_chunks(file["id"])),
           "batch_record": await _usage(redis, keys.batch(bid)),
           "results_while_running": results, "output_file_bytes": len(output),
           "output_file": await _usage(redis, keys.file("file-out"), keys.file_chunks("file-out"))}
    say(f"memory, {n} lines: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "lines"))
    return row


async def _hscan(redis: Any, key: str) -> Any:
    async for _, v in redis.hscan_iter(key):
        yield v


# --- report ----------------------------------------------------------------------------------------------------------
def markdown(args: argparse.Namespace, model: str, pairs: list[Pair], mem: list[dict[str, Any]]) -> str:
    out = ["# Batch API (issue 50)", ""]
    if pairs:
        best_raw = max(p.raw_tok_s for p in pairs)
        best_batch = max(p.batch_tok_s for p in pairs)
        med = statistics.median(p.ratio for p in pairs)
        ratio = best_batch / best_raw
        out += [f"Model `{Path(model).name}`, {args.lines} chat lines of {args.max_tokens} tokens, capacity "
                f"{args.capacity}, window {args.window}, {len(pairs)} raw/batch pair(s), on a shared machine.", "",
                "| pair | raw tok/s | batch tok/s | batch ÷ raw | queue alone tok/s: interactive, bulk (bulk ÷ "
                "interactive) | CPU s: feeder, worker, Redis |",
                "|---|---|---|---|---|---|"]
        out += [f"| {i + 1} | {p.raw_tok_s:.1f} | {p.batch_tok_s:.1f} | {p.ratio:.3f} | {_bands_cell(p)} | "
                f"{p.feeder_cpu_s:.1f}, {p.worker_cpu_s:.1f}, {p.redis_cpu_s:.1f} |" for i, p in enumerate(pairs)]
        verdict = "PASS" if ratio >= TARGET else "MISS"
        out += ["", f"Best raw {best_raw:.1f} tok/s, best batch {best_batch:.1f} tok/s: batch ÷ raw "
                f"**{ratio:.3f}** (target ≥ {TARGET}: {verdict}); median of pairs {med:.3f}.", ""]
        if all(p.queue_tok_s for p in pairs):
            out += [f"The bulk band ÷ interactive, the same requests by a Client: median of pairs "
                    f"{statistics.median(p.band_ratio for p in pairs):.3f} (a batch alone should lose nothing to "
                    "its band: ~1).", ""]
    if mem:
        out += ["| lines | input file (bytes → Redis) | batch record | results while running | output file "
                "(bytes → Redis) |", "|---|---|---|---|---|"]
        out += [f"| {m['lines']} | {m['input_file_bytes']} → {m['input_file']} | {m['batch_record']} | "
                f"{m['results_while_running']} | {m['output_file_bytes']} → {m['output_file']} |" for m in mem]
    return "\n".join(out) + "\n"


def _bands_cell(p: Pair) -> str:
    return f"{p.queue_tok_s:.1f}, {p.queue_bulk_tok_s:.1f} ({p.band_ratio:.3f})" if p.queue_tok_s else "-"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.no_reexec:
        reexec_with_openblas(["-m", "tests.perf.batch", *(sys.argv[1:] if argv is None else argv)], _ROOT)
    args.size = args.size or ("tiny" if args.quick else "small")
    args.lines = args.lines or (64 if args.quick else 1000)
    args.max_tokens = args.max_tokens or (8 if args.quick else 32)
    args.runs = args.runs or (1 if args.quick else 2)
    phases = set(args.phases.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(args.size))
    mem_sizes = [100] if args.quick else [int(n) for n in args.memory_lines.split(",")]
    mem = asyncio.run(memory(mem_sizes)) if "memory" in phases else []
    pairs = throughput(args, model, out) if "throughput" in phases else []
    (out / "batch.json").write_text(json.dumps({"args": vars(args), "pairs": [asdict(p) for p in pairs],
                                                "memory": mem}, indent=1))
    text = markdown(args, model, pairs, mem)
    (out / "batch.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
