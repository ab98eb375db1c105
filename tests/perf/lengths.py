"""Many jobs of random prompt lengths through a real worker process: every one must end, and the worker live on.

On MLX's CUDA backend an attention over several positions (a prefill chunk) builds a cuDNN graph per new shape,
and MLX's cache-thrashing check, when on, throws once its caches have missed more than twice their capacity (256
graphs), ending every job in the engine: a run of 2,000 jobs whose prompts all differ in length meets far more
shapes than that. ``python3 -m tests.perf.lengths --jobs 2000 --model DIR --longest 700`` (a bfloat16 model with
a context of 4,096: cuDNN serves no float32) writes ``lengths.json``: the jobs' outcomes, the time they took, the
worker's exit and how often its log mentions thrashing. On a CPU it runs the generated tiny model (no per-shape
build there: a check of the path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

WORDS = ("alpha", "beta", "gamma", "delta", "quick", "brown", "fox", "12345", "67890", "queue", "batch", "river")


async def submit_all(url: str, model: str, jobs: int, longest: int, seed: int) -> tuple[Counter[str], float]:
    """Submit ``jobs`` of random lengths (4 to ``longest`` words, 2 tokens each) and wait for each one's end."""
    from mlxq.api.client import Client
    from mlxq.api.errors import NoWorker

    rng = random.Random(seed)
    async with Client(url) as client:
        for _ in range(240):  # the worker loads its model first
            try:
                await client.result(await client.submit(model=model, prompt="warm", max_tokens=1,
                                                        require_worker=True))
                break
            except NoWorker:
                await asyncio.sleep(0.5)
        start = time.perf_counter()
        ids = [await client.submit(model=model, max_tokens=2,
                                   prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, longest))))
               for _ in range(jobs)]
        outcomes: Counter[str] = Counter()
        gate = asyncio.Semaphore(256)

        async def wait(job: str) -> None:
            async with gate:
                try:
                    result = await asyncio.wait_for(client.result(job), 600)
                    outcomes[f"done:{result.finish_reason.value}"] += 1
                except Exception as exc:  # an error event, or none in time: what the run is here to count
                    outcomes[f"error:{type(exc).__name__}: {str(exc).split(':')[0][:40]}"] += 1

        await asyncio.gather(*(wait(j) for j in ids))
        return outcomes, time.perf_counter() - start


async def run(jobs: int, model: Path, longest: int, log: Path) -> dict[str, object]:
    from mlxq.worker.tools.redis_server import RedisServer

    with RedisServer() as redis, log.open("w") as out:
        env = {**os.environ, "MLXQ_MODEL": str(model), "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": redis.url,
               "MLXQ_BATCH_CAPACITY": "64", "MLXQ_LOG_LEVEL": "INFO", "MLXQ_DRAIN_TIMEOUT": "2"}
        worker = subprocess.Popen([sys.executable, "-m", "arq", "mlxq.worker.Settings"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        try:
            outcomes, seconds = await submit_all(redis.url, "m", jobs, longest, seed=0)
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    text = log.read_text()
    return {"jobs": jobs, "seconds": round(seconds, 1), "outcomes": dict(outcomes), "worker_exit": worker.returncode,
            "thrashing_lines": sum("thrash" in line.lower() for line in text.splitlines()),
            "check": os.environ.get("MLX_ENABLE_CACHE_THRASHING_CHECK", "unset (the worker turns it off)")}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.lengths", description=__doc__)
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--model", default=None, help="a model directory (default: the generated tiny model)")
    p.add_argument("--longest", type=int, default=100, help="the longest prompt, in words (a word is about 4 "
                   "tokens: the tiny model's context is 512)")
    p.add_argument("--out", default="perf-out")
    args = p.parse_args(argv)
    from mlxq.worker.tools.tinymodel import ensure_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else ensure_model("tiny")
    report = asyncio.run(run(args.jobs, model, args.longest, out / "lengths-worker.log"))
    (out / "lengths.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    outcomes = report["outcomes"]
    return 0 if isinstance(outcomes, dict) and set(outcomes) <= {"done:length", "done:stop"} else 1


if __name__ == "__main__":
    sys.exit(main())
