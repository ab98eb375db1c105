"""``python3 -m tests.perf.embeddings``: embedding inputs/s with N jobs in flight through the queue, against the
model's own batched forward pass (issue 50's target: queue ÷ raw ≥ 0.9 at N = 32), runs alternated.

- **raw**: in this process, mlx-lm's inner model (``model.model``) over batches of N inputs (right-padded to the
  batch's longest, as the engine pads them), the last token pooled and normalised, evaluated to host memory:
  the ceiling;
- **queue**: ``Client.embed`` from N concurrent callers, each sending its next one-input job when its last one
  ended (N in flight), through an embedded Redis to an ``arq mlxq.worker.Settings`` process serving the model
  (``MLXQ_BATCH_CAPACITY`` = N), the inputs tokenized by the worker.

Both take the same texts (each about ``--tokens`` tokens, from the generated corpus), for ``--seconds`` a run. The
worker is stopped (SIGSTOP) during raw runs. Per path: each run's inputs/s, the best run's; the ratio: the median of
each queue run's ratio to the raw run before it, and best ÷ best. OpenBLAS is preloaded as ``mlxq bench`` does.
Writes ``embeddings.json`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mlxq.api.client import Client
from mlxq.worker.tools.bench.preload import reexec_with_openblas
from mlxq.worker.tools.bench.runs import SETTLE_S, percentile, say
from mlxq.worker.tools.blas import blas_of
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

_ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.embeddings", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf-out")
    p.add_argument("--size", default="small-embed", help="generated embedding model (tiny-embed, small-embed)")
    p.add_argument("--n", type=int, default=32, help="jobs in flight (also the raw batch and the batch capacity)")
    p.add_argument("--tokens", type=int, default=64, help="about this many tokens an input")
    p.add_argument("--seconds", type=float, default=8.0, help="length of a run")
    p.add_argument("--runs", type=int, default=3, help="measured runs per path, alternated")
    p.add_argument("--blas-threads", type=int, default=2, help="OPENBLAS_NUM_THREADS of both paths")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    reexec_with_openblas(["-m", "tests.perf.embeddings", *(sys.argv[1:] if argv is None else argv)], _ROOT)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(args.size))
    texts = _texts(model, args.tokens, 4 * args.n)
    raw_runs, queue_runs = _measure(args, model, texts, out)
    pairs = [q / r for r, q in zip(raw_runs, queue_runs, strict=True)]
    summary = {"raw_inputs_s": [round(v, 1) for v in raw_runs], "queue_inputs_s": [round(v, 1) for v in queue_runs],
               "raw_best": max(raw_runs), "queue_best": max(queue_runs), "ratio_median_of_pairs": percentile(pairs, 50),
               "ratio_best": max(queue_runs) / max(raw_runs)}
    (out / "embeddings.json").write_text(json.dumps({"args": vars(args), "blas": blas_of(), "summary": summary},
                                                    indent=1))
    say(f"[{args.size}] N={args.n}, ~{args.tokens} tokens an input, {args.seconds:.0f} s runs")
    say(f"raw   inputs/s per run {summary['raw_inputs_s']}: best {summary['raw_best']:.1f}")
    say(f"queue inputs/s per run {summary['queue_inputs_s']}: best {summary['queue_best']:.1f}")
    say(f"queue ÷ raw: median of pairs {summary['ratio_median_of_pairs']:.3f}, best runs {summary['ratio_best']:.3f} "
        f"(target ≥ 0.9)")
    return 0


def _texts(model: str, tokens: int, count: int) -> list[str]:
    """``count`` distinct texts of about ``tokens`` tokens each (the model's tokenizer's count), from the corpus."""
    from mlx_lm.utils import load_tokenizer

    from mlxq.worker.tools.tinymodel import corpus

    tokenizer = load_tokenizer(Path(model))
    lines = corpus(seed=7)
    texts, at = [], 0
    for _ in range(count):
        text = ""
        while len(tokenizer.encode(text)) < tokens:
            text += lines[at % len(lines)] + " "
            at += 1
        texts.append(text.strip())
    return texts


def _measure(args: argparse.Namespace, model: str, texts: list[str], out: Path) -> tuple[list[float], list[float]]:
    raw = _Raw(model, texts, args.n)
    with RedisServer() as redis:
        prefix = f"mlxq-embed-{os.getpid()}"
        worker = WorkerProcess({"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": args.size, "MLXQ_REDIS_URL": redis.url,
                                "MLXQ_PREFIX": prefix, "MLXQ_BATCH_CAPACITY": str(args.n), "MLXQ_HEARTBEAT": "0.5",
                                "OPENBLAS_NUM_THREADS": str(args.blas_threads)},
                               out / "logs" / "embeddings-worker.log").start()
        try:
            worker.wait_ready()
            assert worker.proc is not None
            say(f"[{args.size}] worker ready; BLAS {blas_of(worker.proc.pid)}")
            return asyncio.run(_alternate(args, raw, texts, redis.url, prefix, worker.proc.pid))
        finally:
            worker.stop()


async def _alternate(args: argparse.Namespace, raw: _Raw, texts: list[str], url: str, prefix: str, pid: int
                     ) -> tuple[list[float], list[float]]:
    raw_runs: list[float] = []
    queue_runs: list[float] = []
    async with Client(url, prefix=prefix) as client:
        for k in range(args.runs + 1):  # the first round warms both up
            seconds = args.seconds if k else 2.0
            os.kill(pid, signal.SIGSTOP)
            time.sleep(SETTLE_S)
            try:
                r = raw.run(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)
                time.sleep(SETTLE_S)
            q = await _queue(client, args.size, texts, args.n, seconds)
            if k:
                raw_runs.append(r)
                queue_runs.append(q)
                say(f"run {k}: raw {r:8.1f} inputs/s, queue {q:8.1f} inputs/s, ratio {q / r:.3f}")
    return raw_runs, queue_runs


class _Raw:
    """The model's own batched forward pass over the texts, N at a time."""

    def __init__(self, model: str, texts: list[str], n: int) -> None:
        import mlx.core as mx
        import mlx_lm
        import numpy as np

        self.mx, self.np = mx, np
        loaded = mlx_lm.load(model)
        self.model, tokenizer = loaded[0], loaded[1]
        rows = [tokenizer.encode(t) for t in texts]
        self.batches: list[tuple[Any, Any]] = []
        for at in range(0, len(rows) - n + 1, n):
            group = sorted(rows[at:at + n], key=len)
            tokens = np.zeros((n, len(group[-1])), dtype=np.int32)
            for i, row in enumerate(group):
                tokens[i, :len(row)] = row
            self.batches.append((mx.array(tokens), mx.array([len(r) for r in group])))
        self.n = n

    def run(self, seconds: float) -> float:
        """Inputs/s over ``seconds`` of back-to-back passes."""
        mx, np = self.mx, self.np
        done, t0, k = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            tokens, lengths = self.batches[k % len(self.batches)]
            hidden = self.model.model(tokens)
            pooled = mx.take_along_axis(hidden, (lengths - 1).reshape(-1, 1, 1), axis=1).squeeze(1)
            pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
            np.asarray(pooled.astype(mx.float32))  # evaluated, in host memory, as the engine hands vectors over
            done += self.n
            k += 1
        return done / (time.perf_counter() - t0)


async def _queue(client: Client, model: str, texts: list[str], n: int, seconds: float) -> float:
    """Inputs/s with ``n`` callers each keeping one one-input job in flight for ``seconds``."""
    done = 0
    end = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        nonlocal done
        k = i
        while time.perf_counter() < end:
            got = await client.embed(model=model, input=texts[k % len(texts)], timeout=60)
            assert len(got.vectors) == 1
            done += 1
            k += n

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(n)))
    return done / (time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
