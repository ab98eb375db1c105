"""The scheduler's features of issue 16, measured on the worker's own ``Engine`` in this process (as the
engine path does, on the raw path's MLX thread and loaded model):

- **prefix cache**: time to first token of a chat job whose long system prompt is cached, against the same
  kind of job cold (a system prompt never seen), probes alternating;
- **KV over-subscription**: jobs whose KV demand (by the engine's own estimate) is three times the headroom,
  all at once; the peak of the caches' measured bytes, that every job completes, and the throughput against
  the same jobs with no KV limit (same slots), runs alternating; peak RSS and MLX's peak memory;
- **priority**: with the batch full of long jobs, the time to first token of a high-priority job, against
  what one prefill of it (its TTFT on an idle engine) plus two decode steps of the full batch take;
- **structured output**: a full batch with half its rows constrained to a JSON schema against the same batch
  free, runs alternating; a constrained job's TTFT at N = 1 (its schema compiled before) against a free one's,
  probes alternating; and what compiling a new schema takes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.bench.runs import PROMPT, percentile, safe_ratio, say

from .runs import BenchConfig

if TYPE_CHECKING:
    from mlxq.engine.core.engine import Engine
    from mlxq.engine.core.request import EngineRequest, RequestOutput

    from .paths import RawPath

_SYSTEM_TOKENS = 2000  # the cached system prompt (at most the context less a margin)
_UNLIMITED = 1 << 50  # "no KV limit"
_WORDS = ("queue", "model", "token", "server", "batch", "cache", "prompt", "worker", "stream", "reply")


@dataclass(frozen=True, slots=True)
class PrefixTtft:
    """TTFT of chat jobs whose system prompt is cached (warm) or new (cold)."""

    system_tokens: int
    prompt_tokens: int
    cold_ms: list[float]
    warm_ms: list[float]
    cold_p50_ms: float
    warm_p50_ms: float
    speedup: float  # cold p50 / warm p50
    hits: int
    tokens_saved: int


@dataclass(frozen=True, slots=True)
class Oversubscribed:
    """All jobs at once, KV demand over the headroom, against the same jobs with no KV limit."""

    jobs: int
    capacity: int
    headroom_bytes: int
    demand_bytes: int  # the jobs' KV by the engine's estimate, summed
    peak_kv_bytes: int  # the caches' measured bytes, highest after any step of the limited runs
    unlimited_peak_kv_bytes: int
    completed: int  # jobs of the limited runs that ended with their full length
    expected: int
    tok_s: list[float]
    unlimited_tok_s: list[float]
    best_ratio: float  # best limited run / best unlimited run
    paired_ratio: float  # median over the run pairs
    most_running: int  # the most sequences decoding at once (limited)
    peak_rss_bytes: int
    mlx_peak_bytes: int


@dataclass(frozen=True, slots=True)
class PriorityTtft:
    """A high-priority job's TTFT with the batch full, against one prefill of it plus two decode steps."""

    background: int
    ttft_ms: list[float]
    ttft_p50_ms: float
    join_ttft_p50_ms: float  # the same job, priority 0, joining the one free slot of a batch otherwise full
    idle_ttft_ms: float  # p50 of the same job on an idle engine: its prefill, to its first token
    step_ms: float  # a decode step of the full batch
    budget_ms: float  # idle TTFT + 2 steps
    preemptions: int


@dataclass(frozen=True, slots=True)
class Structured:
    """Constrained rows in the batch: throughput, TTFT, and a new schema's compile time."""

    jobs: int
    constrained: int  # of them
    tok_s: list[float]  # half constrained
    free_tok_s: list[float]  # none constrained
    paired_ratio: float  # median over the run pairs
    ttft_p50_ms: float  # N = 1, constrained (schema seen before)
    free_ttft_p50_ms: float
    compile_ms: float  # a schema never seen
    valid: int  # constrained outputs of the measured runs that parse as JSON
    checked: int


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The four measurements on one model size."""

    prefix: PrefixTtft
    oversubscribed: Oversubscribed
    priority: PriorityTtft
    structured: Structured | None = None


class _Driver:
    """Requests into an engine, their outputs timed where they leave it (on the MLX thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.added: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.ended: dict[str, RequestOutput] = {}
        self.finished_at: dict[str, float] = {}
        self.texts: dict[str, str] = {}
        self._futures: dict[str, asyncio.Future[None]] = {}

    def sink(self, outs: list[RequestOutput]) -> None:  # on the MLX thread
        now = time.perf_counter()
        for out in outs:
            if out.text:
                self.texts[out.rid] = self.texts.get(out.rid, "") + out.text
            if out.token_ids:
                self.first.setdefault(out.rid, now)
            if out.finish is not None:
                self.ended[out.rid] = out
                self.finished_at[out.rid] = now
                fut = self._futures.get(out.rid)
                if fut is not None:
                    self.loop.call_soon_threadsafe(_resolve, fut)

    def add(self, engine: Engine, req: EngineRequest, *, collect: bool = False) -> asyncio.Future[None]:
        """Add ``req``; the future resolves when it ends. ``collect``: a garbage collection first, so none
        lands inside a timed probe (the worker keeps its start-up objects out of the collector's sight)."""
        if collect:
            gc.collect()
        fut = self._futures[req.rid] = self.loop.create_future()
        self.added[req.rid] = time.perf_counter()
        engine.add(req)
        return fut

    def ttft_ms(self, rid: str) -> float:
        return (self.first[rid] - self.added[rid]) * 1000


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def run_scheduling(raw: RawPath, cfg: BenchConfig, size: str) -> SchedulingResult:
    """The three measurements on ``raw``'s model and MLX thread."""
    driver = _Driver(asyncio.get_running_loop())
    prefix = await _prefix_ttft(raw, cfg, driver, size)
    over = await _oversubscribed(raw, cfg, driver, size)
    prio = await _priority_ttft(raw, cfg, driver, size)
    structured = await _structured(raw, cfg, driver, size)
    return SchedulingResult(prefix, over, prio, structured)


async def _engine(raw: RawPath, driver: _Driver, capacity: int, **options: Any) -> Engine:
    from mlxq.engine.mlx.loader import EngineOptions, build_engine

    d = WorkerConfig()
    opts = EngineOptions(capacity, d.prefill_batch_size, d.prefill_step_size, 0.0, **options)
    return await build_engine(raw.loaded, raw.thread, driver.sink, opts)


def _close(raw: RawPath, engine: Engine) -> None:
    raw.thread.submit(engine.scheduler.backend.close).result()  # the thread is shared: not engine.aclose()


# --- (a) the prefix cache ------------------------------------------------------------------------------
async def _prefix_ttft(raw: RawPath, cfg: BenchConfig, driver: _Driver, size: str) -> PrefixTtft:
    """Cold: an engine without a prefix cache; warm: one whose cache holds the system prompt. Alternating."""
    from mlxq.engine.core.prompt import encode_prompt_with_boundary
    from mlxq.engine.core.request import EngineRequest, SamplingParams

    tokenizer = raw.loaded.tokenizer
    system = _system_prompt(tokenizer, min(_SYSTEM_TOKENS, (raw.loaded.context_length or 4096) - 64))
    cached = await _engine(raw, driver, 4)
    uncached = await _engine(raw, driver, 4, prefix_cache_bytes=0)

    def job(rid: str, question: str) -> EngineRequest:
        e = encode_prompt_with_boundary(tokenizer, None, [{"role": "system", "content": system},
                                                          {"role": "user", "content": question}])
        return EngineRequest(rid, e.tokens, SamplingParams(max_tokens=2), cache_boundary=e.cache_boundary)

    first = job("prefix-prime", "Say hello.")
    await driver.add(cached, first)  # caches the system prompt (and warms both engines up)
    await driver.add(uncached, job("prefix-warm-up", "Say hello."))
    cold: list[float] = []
    warm: list[float] = []
    for k in range(cfg.scheduling_probes):
        question = f"Question {k}: what is a {_WORDS[k % len(_WORDS)]}?"
        for engine, rid, out in ((uncached, f"prefix-cold-{k}", cold), (cached, f"prefix-warm-{k}", warm)):
            await asyncio.sleep(0.1)
            await driver.add(engine, job(rid, question), collect=True)
            out.append(driver.ttft_ms(rid))
    _close(raw, cached)
    _close(raw, uncached)
    stats = cached.stats
    cold_p50, warm_p50 = percentile(cold, 50), percentile(warm, 50)
    result = PrefixTtft(first.cache_boundary, len(first.prompt_tokens), cold, warm, cold_p50, warm_p50,
                        safe_ratio(cold_p50, warm_p50), stats.prefix_hits, stats.prefix_tokens_saved)
    say(f"[{size}] prefix cache: {result.system_tokens}-token system prompt, TTFT p50 cold "
         f"{result.cold_p50_ms:.1f} ms, cached {result.warm_p50_ms:.1f} ms ({result.speedup:.1f}x)")
    return result


def _system_prompt(tokenizer: Any, tokens: int) -> str:
    """A system prompt of at most ``tokens`` tokens (and not many fewer)."""
    words = [_WORDS[(i * 7) % len(_WORDS)] for i in range(tokens)]
    n = tokens
    while n > 1 and len(tokenizer.encode(" ".join(words[:n]))) > tokens:
        n = n * 9 // 10
    return " ".join(words[:n])


# --- (b) over-subscription ------------------------------------------------------------------------------
async def _oversubscribed(raw: RawPath, cfg: BenchConfig, driver: _Driver, size: str) -> Oversubscribed:
    from mlxq.engine.core.request import EngineRequest, SamplingParams
    from mlxq.engine.mlx.memory import measure_layout

    rng = random.Random(0)
    capacity = cfg.capacity
    shapes = [(raw.encode([PROMPT.format(i=5000 + i)])[0], rng.randint(cfg.max_tokens // 2, cfg.max_tokens * 3 // 2))
              for i in range(3 * capacity)]
    layout = await raw.thread.call(measure_layout, raw.loaded.model)
    demand = sum(layout.row_bytes(len(p) + m) for p, m in shapes)
    headroom = demand // 3
    limited = await _engine(raw, driver, capacity, kv_headroom_bytes=headroom, prefix_cache_bytes=0)
    unlimited = await _engine(raw, driver, capacity, kv_headroom_bytes=_UNLIMITED, prefix_cache_bytes=0)
    runs: dict[str, list[float]] = {"limited": [], "unlimited": []}
    peaks = {"limited": 0, "unlimited": 0}
    completed, most, rss, mlx_peak = 0, 0, 0, 0
    for r in range(cfg.scheduling_repeats + 1):  # the first round, 4 tokens a job, warms both up
        for name, engine in (("limited", limited), ("unlimited", unlimited)):
            await asyncio.sleep(0.3)
            gc.collect()
            engine.stats.kv_bytes_peak = 0
            await raw.thread.call(_reset_mlx_peak)
            reqs = [EngineRequest(f"over-{name}-{r}-{i}", p, SamplingParams(max_tokens=m if r else 4))
                    for i, (p, m) in enumerate(shapes)]
            seconds, tokens, running, run_rss = await _all_at_once(engine, driver, reqs)
            if r == 0:
                continue
            runs[name].append(tokens / seconds)
            peaks[name] = max(peaks[name], engine.stats.kv_bytes_peak)
            if name == "limited":
                completed += sum(driver.ended[q.rid].completion_tokens == q.params.max_tokens for q in reqs)
                most, rss = max(most, running), max(rss, run_rss)
                mlx_peak = max(mlx_peak, await raw.thread.call(_mlx_peak))
    _close(raw, limited)
    _close(raw, unlimited)
    paired = [safe_ratio(a, b) for a, b in zip(runs["limited"], runs["unlimited"])]
    result = Oversubscribed(len(shapes), capacity, headroom, demand, peaks["limited"], peaks["unlimited"], completed,
                            len(shapes) * cfg.scheduling_repeats, runs["limited"], runs["unlimited"],
                            safe_ratio(max(runs["limited"]), max(runs["unlimited"])), percentile(paired, 50), most, rss,
                            mlx_peak)
    say(f"[{size}] KV over-subscription: {result.jobs} jobs, demand {demand / headroom:.1f}x the headroom; peak "
         f"{result.peak_kv_bytes / headroom:.2f} of it (unlimited: {result.unlimited_peak_kv_bytes / headroom:.2f}); "
         f"{completed}/{result.expected} complete; {max(runs['limited']):.0f} against {max(runs['unlimited']):.0f} "
         f"tok/s unlimited ({result.best_ratio:.2f}, paired {result.paired_ratio:.2f}); at most {most} running")
    return result


async def _all_at_once(engine: Engine, driver: _Driver, reqs: list[EngineRequest]) -> tuple[float, int, int, int]:
    """Add every request at once; wall time, completion tokens, most running at once, peak RSS meanwhile."""
    t0 = time.perf_counter()
    futures = [driver.add(engine, q) for q in reqs]
    done = asyncio.gather(*futures)
    most, rss = 0, _rss_bytes()
    while not done.done():
        most = max(most, engine.scheduler.num_running)
        rss = max(rss, _rss_bytes())
        await asyncio.wait([done], timeout=0.02)
    end = max(out_time for out_time in (driver.finished_at[q.rid] for q in reqs))
    return end - t0, sum(driver.ended[q.rid].completion_tokens for q in reqs), most, rss


def _reset_mlx_peak() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


def _mlx_peak() -> int:
    import mlx.core as mx

    return int(mx.get_peak_memory())


def _rss_bytes() -> int:
    """Resident set size now (Linux); elsewhere the process's peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


# --- (c) priority ------------------------------------------------------------------------------------------
async def _priority_ttft(raw: RawPath, cfg: BenchConfig, driver: _Driver, size: str) -> PriorityTtft:
    """Idle TTFT (one prefill); then, with every slot but one decoding, a normal job joining the free slot;
    then, every slot decoding, a priority job (which preempts one)."""
    from mlxq.engine.core.request import EngineRequest, SamplingParams

    capacity = cfg.capacity
    engine = await _engine(raw, driver, capacity, prefix_cache_bytes=0)
    urgent = raw.encode([PROMPT.format(i=9000)])[0]

    async def probes(tag: str, priority: int, warm_up: bool = False) -> list[float]:
        out = []
        for k in range(cfg.scheduling_probes + warm_up):
            rid = f"prio-{tag}-{k}"
            gc.collect()  # none inside a probe (the worker keeps its start-up objects out of the collector's sight)
            await asyncio.sleep(step_ms / 1000 * random.Random(k).random())  # anywhere within a step
            await driver.add(engine, EngineRequest(rid, urgent, SamplingParams(max_tokens=2), priority=priority))
            if k or not warm_up:
                out.append(driver.ttft_ms(rid))
        return out

    step_ms = 0.0
    idle = await probes("idle", 0, warm_up=True)
    ctx = raw.loaded.context_length or 4096
    background = [EngineRequest(f"prio-bg-{i}", p, SamplingParams(max_tokens=ctx - len(p) - 8))
                  for i, p in enumerate(raw.encode([PROMPT.format(i=7000 + i) for i in range(capacity)]))]
    for q in background[:-1]:
        driver.add(engine, q)
    step_ms = await _decoding(engine, driver, background[:-1])
    join = await probes("join", 0)
    driver.add(engine, background[-1])
    step_ms = await _decoding(engine, driver, background)
    ttft = await probes("urgent", 100)
    preemptions = engine.stats.preemptions
    for q in background:
        engine.abort(q.rid)
    await asyncio.gather(*(driver._futures[q.rid] for q in background))
    _close(raw, engine)
    result = PriorityTtft(capacity, ttft, percentile(ttft, 50), percentile(join, 50), percentile(idle, 50), step_ms,
                          percentile(idle, 50) + 2 * step_ms, preemptions)
    say(f"[{size}] priority: TTFT p50 {result.ttft_p50_ms:.1f} ms with {capacity} long jobs decoding (one "
         f"prefill {result.idle_ttft_ms:.1f} ms + two steps of {step_ms:.1f} ms: {result.budget_ms:.1f} ms; a job "
         f"joining a free slot: {result.join_ttft_p50_ms:.1f} ms); {preemptions} preemptions")
    return result


async def _decoding(engine: Engine, driver: _Driver, jobs: list[EngineRequest]) -> float:
    """Wait until every job of ``jobs`` has its first token; then the mean of 20 steps, in ms."""
    while not all(q.rid in driver.first for q in jobs):
        await asyncio.sleep(0.01)
    steps0, t0 = engine.stats.steps, time.perf_counter()
    while engine.stats.steps < steps0 + 20:
        await asyncio.sleep(0.005)
    return (time.perf_counter() - t0) * 1000 / (engine.stats.steps - steps0)


# --- (d) structured output ----------------------------------------------------------------------------------
# A string that runs to max_tokens: constrained rows make as many tokens as free ones, so tok/s compares alike.
_OPEN_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


async def _structured(raw: RawPath, cfg: BenchConfig, driver: _Driver, size: str) -> Structured:
    """Alternating runs of a full batch, half constrained or all free; then alternating N = 1 TTFT probes."""
    import json

    from mlxq.engine.core.request import EngineRequest, SamplingParams
    from mlxq.engine.mlx.constrain import FormatKind, Grammars, ResponseFormat, vocab_size

    loaded = raw.loaded
    grammars = Grammars(loaded.tokenizer._tokenizer, vocab_size(loaded.model, loaded.tokenizer),
                        loaded.eos_token_ids)
    t0 = time.perf_counter()
    grammar = grammars.compile(ResponseFormat(FormatKind.JSON_SCHEMA, json.dumps(_OPEN_SCHEMA)))
    compile_ms = (time.perf_counter() - t0) * 1000
    n = cfg.capacity
    engine = await _engine(raw, driver, n, prefix_cache_bytes=0)
    prompts = raw.encode([PROMPT.format(i=5000 + i) for i in range(n)])

    async def batch(tag: str, constrained: bool) -> float:
        jobs = [EngineRequest(f"json-{tag}-{i}", p, SamplingParams(max_tokens=cfg.max_tokens),
                              format=grammar if constrained and i % 2 else None) for i, p in enumerate(prompts)]
        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(driver.add(engine, q) for q in jobs))
        tokens = sum(driver.ended[q.rid].completion_tokens for q in jobs)
        return tokens / (time.perf_counter() - t0)

    await batch("warm", True)
    mixed: list[float] = []
    free: list[float] = []
    for k in range(cfg.scheduling_repeats * 2):
        free.append(await batch(f"free-{k}", False))
        mixed.append(await batch(f"mixed-{k}", True))
    checked = [f"json-mixed-{k}-{i}" for k in range(len(mixed)) for i in range(1, n, 2)]
    valid = sum(_is_json_prefix(driver.texts.get(rid, "")) for rid in checked)
    ttft: list[float] = []
    free_ttft: list[float] = []
    for k in range(cfg.scheduling_probes * 2):
        for fmt, out in ((None, free_ttft), (grammar, ttft)):
            rid = f"json-ttft-{'c' if fmt else 'f'}-{k}"
            await asyncio.sleep(0.05)
            await driver.add(engine, EngineRequest(rid, prompts[k % n], SamplingParams(max_tokens=2), format=fmt),
                             collect=True)
            out.append(driver.ttft_ms(rid))
    _close(raw, engine)
    ratios = [m / f for m, f in zip(mixed, free)]
    result = Structured(n, n // 2, mixed, free, percentile(ratios, 50), percentile(ttft, 50),
                        percentile(free_ttft, 50), compile_ms, valid, len(checked))
    say(f"[{size}] structured output: N={n}, half under a JSON schema: {percentile(mixed, 50):.1f} against "
         f"{percentile(free, 50):.1f} tok/s all free ({result.paired_ratio:.2f}x paired); TTFT p50 at N=1 "
         f"{result.ttft_p50_ms:.1f} ms constrained, {result.free_ttft_p50_ms:.1f} ms free; a new schema compiled in "
         f"{compile_ms:.1f} ms; {valid}/{len(checked)} constrained outputs valid")
    return result


def _is_json_prefix(text: str) -> bool:
    """Whether ``text`` starts the JSON object of ``_OPEN_SCHEMA`` (max_tokens cuts it inside its string)."""
    return text.startswith('{"answer":"')
