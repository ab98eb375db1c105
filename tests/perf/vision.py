"""The benchmark's image phase: how much of mlx-vlm's own batching survives the queue, for image jobs.

On the generated qwen2_vl models (``worker/tools/tinyvlm.py``: the tiny one, and with the small text model the small
one, whose steps take tens of ms as a real model's do), one image per job, greedy, ``max_tokens`` each:

- **raw**: mlx-vlm's ``BatchGenerator`` driven in this process on its own MLX thread, with what any server
  of these requests does per request before it: decode the image (mlx-vlm's ``load_image``, from the same
  data URL), its processor (``prepare_inputs``) and ``get_input_embeddings``; then every row is inserted
  and the batch stepped until all end: the ceiling;
- **queue**: ``mlxq.api.client.Client`` -> Redis -> ``arq mlxq.worker.Settings`` serving the model (a child process)
  -> pub/sub -> the client: image jobs as a web backend sends them (OpenAI content parts).

Raw and queue runs alternate at each N (the idle worker SIGSTOPped during raw runs), as the text phase's.

And, for the vision-language worker's text rows, the choice between mlx-vlm and mlx-lm, in this process:
text prompts on the same checkpoint through mlx-vlm's ``BatchGenerator`` (rows carrying embeddings, as the
worker runs them) and through mlx-lm's (its qwen2_vl text model), alternating; and a mixed load (half image
jobs, half text) in one mlx-vlm batch against image rows on mlx-vlm beside text rows on mlx-lm (two batches,
both stepped every step). The worker keeps text rows in the one mlx-vlm batch; this says whether mlx-lm
would be faster.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.worker.tools.bench.runs import SETTLE_S, TIMEOUT_S, PathResult, Run, paired_median, safe_ratio, say
from mlxq.worker.tools.process import WorkerProcess

from .paths import EngineClock, alternate_runs, openblas_in_use
from .runs import BenchConfig, Site, Target, fmt_runs

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxq.engine.mlx.loader import LoadedModel
    from mlxq.engine.mlx.thread import MLXThread
    from mlxq.worker.service import ModelService
    from mlxq.worker.tools.tinyvlm import VLMSpec

__all__ = ["MixedRows", "TextRows", "VisionResult", "VisionRow", "md_vision", "run_vision", "vision_targets"]

TEXT = "Describe picture {i} and the water in it"
_IMAGE_SIZE = (64, 48)  # 12 image tokens after the processor's 2x2 merge
_FLOOR = 0.9  # issue 17: image jobs through the queue / mlx-vlm's BatchGenerator in-process
_TINY_FLOOR = 0.8  # issue 3's floor for the overhead-dominated tiny model (see vision_targets)
_BLAS_THREADS = 1  # the same on both paths (a 64-wide model's gemms are too small to split over threads)


@dataclass(frozen=True, slots=True)
class VisionRow:
    """Image jobs at one N: mlx-vlm's BatchGenerator in-process (raw), the worker's model service in-process
    (engine) and the queue."""

    n: int
    raw: PathResult
    engine: PathResult
    queue: PathResult
    queue_over_raw: float  # best runs
    queue_over_raw_paired: float  # median over the run pairs
    engine_over_raw_paired: float  # median over the runs of engine run i / raw run i
    queue_over_engine_paired: float  # median over the runs of queue run i / engine run i


@dataclass(frozen=True, slots=True)
class TextRows:
    """Text prompts on the vision-language checkpoint at one N: mlx-vlm's batch against mlx-lm's."""

    n: int
    vlm: PathResult
    lm: PathResult
    vlm_over_lm_paired: float


@dataclass(frozen=True, slots=True)
class MixedRows:
    """Half image jobs, half text jobs at once: one mlx-vlm batch, against text rows on mlx-lm beside it."""

    n: int
    one_batch: PathResult
    split: PathResult
    one_over_split_paired: float


@dataclass(frozen=True, slots=True)
class VisionResult:
    """The image phase on one model (``results.json``: ``vision``, one per model)."""

    name: str  # the served name: the spec's
    model: str
    image_size: tuple[int, int]
    blas_threads: int | None  # None: no OpenBLAS to set
    rows: list[VisionRow]
    text_rows: list[TextRows]
    mixed: MixedRows
    seconds: float


def run_vision(cfg: BenchConfig, site: Site) -> list[VisionResult]:
    """Measure the image phase (see the module docstring) on the tiny qwen2_vl, and on the small one when the
    small text model is measured too."""
    from mlxq.worker.tools.tinyvlm import SMALL_VLM, TINY_VLM

    return [_run_model(spec, cfg, site) for spec in (TINY_VLM, SMALL_VLM) if spec is TINY_VLM or "small" in cfg.sizes]


def _run_model(spec: VLMSpec, cfg: BenchConfig, site: Site) -> VisionResult:
    from mlxq.worker.tools.tinyvlm import ensure_vlm

    t0 = time.perf_counter()
    model = str(ensure_vlm(spec=spec))
    say(f"[{spec.name}] model {model}")
    raw = _RawVision(spec.name, model, max(cfg.vision_concurrency))
    try:
        blas = raw.set_blas_threads(_BLAS_THREADS)
        env = {"OPENBLAS_NUM_THREADS": str(_BLAS_THREADS)} if blas else {}
        text_rows = [asyncio.run(_text_rows(raw, cfg, n)) for n in cfg.vision_concurrency]
        mixed = asyncio.run(_mixed_rows(raw, cfg, max(cfg.vision_concurrency)))
        rows = _queue_phase(model, cfg, site, raw, env)
    finally:
        raw.close()
    return VisionResult(spec.name, model, _IMAGE_SIZE, _BLAS_THREADS if blas else None, rows, text_rows, mixed,
                        time.perf_counter() - t0)


def _jobs(n: int) -> list[tuple[str, str]]:
    """(text, image data URL) of N image jobs, each with its own picture."""
    import io

    import numpy as np
    from PIL import Image  # the worker extra's

    from mlxq.api.schema import image_data_url

    out = []
    for i in range(n):
        buf = io.BytesIO()
        w, h = _IMAGE_SIZE
        Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype("uint8")).save(buf, format="PNG")
        out.append((TEXT.format(i=i), image_data_url(buf.getvalue())))
    return out


def _messages(text: str, url: str | None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if url is not None:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": parts}]


# --- raw: mlx-vlm's BatchGenerator in this process -------------------------------------------------------
class _RawVision:
    """The model loaded once on this process's own MLX thread, as the worker loads it."""

    def __init__(self, name: str, model: str, capacity: int) -> None:
        from mlxq.engine.mlx.loader import load_model
        from mlxq.engine.mlx.thread import MLXThread

        self.name = name
        self.path = model
        self.thread: MLXThread = MLXThread(name="mlx-bench-vl")
        self.loaded: LoadedModel = self.thread.submit(load_model, model).result()
        self.capacity = capacity
        self._lm: Any = None

    def set_blas_threads(self, n: int) -> bool:
        blas = openblas_in_use()
        if blas is None:
            return False
        self.thread.submit(blas.openblas_set_num_threads, n).result()
        return True

    async def images(self, jobs: list[tuple[str, str]], max_tokens: int) -> Run:
        fut = self.thread.submit(_raw_images, self.loaded, jobs, max_tokens, self.capacity, self.thread.stream)
        return await asyncio.wrap_future(fut)

    async def text_vlm(self, prompts: list[list[int]], max_tokens: int) -> Run:
        fut = self.thread.submit(_raw_text_vlm, self.loaded, prompts, max_tokens, self.capacity, self.thread.stream)
        return await asyncio.wrap_future(fut)

    async def text_lm(self, prompts: list[list[int]], max_tokens: int) -> Run:
        from mlxq.worker.tools.bench.paths import raw_run

        fut = self.thread.submit(raw_run, await self._lm_model(), prompts, max_tokens, self.capacity,
                                 self.thread.stream)
        return await asyncio.wrap_future(fut)

    async def mixed(self, jobs: list[tuple[str, str]], prompts: list[list[int]], max_tokens: int, split: bool
                    ) -> Run:
        lm = await self._lm_model() if split else None
        fut = self.thread.submit(_raw_mixed, self.loaded, lm, jobs, prompts, max_tokens, self.capacity,
                                 self.thread.stream)
        return await asyncio.wrap_future(fut)

    async def _lm_model(self) -> LoadedModel:
        if self._lm is None:
            self._lm = await asyncio.wrap_future(self.thread.submit(_load_lm, self.path))
        return self._lm  # type: ignore[no-any-return]

    def close(self) -> None:
        self.thread.shutdown()


def _load_lm(path: str) -> LoadedModel:
    """The checkpoint's text model as mlx-lm loads it (its own qwen2_vl module), on the MLX thread."""
    import mlx_lm

    from mlxq.engine.core.prompt import PromptEncoder
    from mlxq.engine.mlx.loader import LoadedModel

    model, tokenizer = mlx_lm.load(path)[:2]
    return LoadedModel(path, model, tokenizer, None, frozenset(tokenizer.eos_token_ids), PromptEncoder(tokenizer))


def _generator(loaded: LoadedModel, capacity: int, stream: mx.Stream) -> Any:
    from mlx_vlm.generate.ar import BatchGenerator

    from mlxq.worker.config import WorkerConfig

    assert loaded.vision is not None
    prefill = min(WorkerConfig().prefill_batch_size, capacity)
    # The worker's batch shape (engine/mlx/vlm.py): admission up to capacity, no log-probabilities.
    return BatchGenerator(loaded.model.language_model, loaded.vision.processor, stop_tokens=set(loaded.eos_token_ids),
                          completion_batch_size=capacity + prefill, prefill_batch_size=prefill,
                          prefill_step_size=WorkerConfig().prefill_step_size, compute_logprobs=False, stream=stream)


def _embedded(loaded: LoadedModel, inputs: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """A prepared prompt's ids and its row's prompt kwargs, as mlx-vlm's server embeds them."""
    ids = inputs["input_ids"]
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    embedded = loaded.model.get_input_embeddings(ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"),
                                                 **extra)
    return ids[0].tolist(), {**extra, **{k: v for k, v in embedded.to_dict().items() if v is not None}}


def _raw_images(loaded: LoadedModel, jobs: list[tuple[str, str]], max_tokens: int, capacity: int,
                stream: mx.Stream) -> Run:
    """Decode, prepare and embed every job's image, insert them all, step until all end (on the MLX thread)."""
    gen = _generator(loaded, capacity, stream)
    try:
        t0 = time.perf_counter()
        uids = _insert_images(loaded, gen, jobs, max_tokens)
        return _drain([gen], uids, t0)
    finally:
        gen.close()


def _raw_text_vlm(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, capacity: int,
                  stream: mx.Stream) -> Run:
    """Text prompts through mlx-vlm's BatchGenerator, each row carrying its embeddings (as the worker's)."""
    gen = _generator(loaded, capacity, stream)
    try:
        t0 = time.perf_counter()
        uids = _insert_texts(loaded, gen, prompts, max_tokens)
        return _drain([gen], uids, t0)
    finally:
        gen.close()


def _raw_mixed(loaded: LoadedModel, lm: LoadedModel | None, jobs: list[tuple[str, str]], prompts: list[list[int]],
               max_tokens: int, capacity: int, stream: mx.Stream) -> Run:
    """Image jobs and text prompts at once: all in one mlx-vlm batch, or (``lm``) the text on mlx-lm's beside
    it, both generators stepped every step."""
    from mlx_lm.generate import BatchGenerator

    gens = [_generator(loaded, capacity, stream)]
    if lm is not None:
        gens.append(BatchGenerator(lm.model, stop_tokens=[[t] for t in sorted(lm.eos_token_ids)],
                                   completion_batch_size=capacity, prefill_batch_size=capacity,
                                   prefill_step_size=512, stream=stream))
    try:
        t0 = time.perf_counter()
        uids = _insert_images(loaded, gens[0], jobs, max_tokens)
        if lm is None:
            uids += _insert_texts(loaded, gens[0], prompts, max_tokens)
        else:
            uids += [-1 - u for u in gens[1].insert(prompts, max_tokens=[max_tokens] * len(prompts))]
        return _drain(gens, uids, t0)
    finally:
        for gen in gens:
            gen.close()


def _insert_images(loaded: LoadedModel, gen: Any, jobs: list[tuple[str, str]], max_tokens: int) -> list[int]:
    from mlx_vlm.utils import load_image, prepare_inputs, should_add_special_tokens

    assert loaded.vision is not None
    vision = loaded.vision
    special = should_add_special_tokens(loaded.model.config.model_type, vision.processor)
    uids: list[int] = []
    for text, url in jobs:
        prompt = vision.render([{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}], 1)
        inputs = prepare_inputs(vision.processor, images=[load_image(url)], prompts=prompt,
                                image_token_index=getattr(loaded.model.config, "image_token_index", None),
                                add_special_tokens=special)
        ids, kwargs = _embedded(loaded, inputs)
        uids += gen.insert([ids], max_tokens=[max_tokens], prompt_kwargs=[kwargs])
    return uids


def _insert_texts(loaded: LoadedModel, gen: Any, prompts: list[list[int]], max_tokens: int) -> list[int]:
    import mlx.core as mx

    uids: list[int] = []
    for tokens in prompts:
        ids = mx.array([tokens])
        _, kwargs = _embedded(loaded, {"input_ids": ids, "attention_mask": mx.ones_like(ids)})
        uids += gen.insert([tokens], max_tokens=[max_tokens], prompt_kwargs=[kwargs])
    return uids


def _drain(gens: list[Any], uids: list[int], t0: float) -> Run:
    """Step every generator until all ``uids`` end (the second generator's uids are given as -1 - uid)."""
    first: dict[int, float] = {}
    live, tokens = set(uids), 0
    while live:
        for k, gen in enumerate(gens):
            _, generated = gen.next()
            now = time.perf_counter()
            for r in generated:
                uid = r.uid if k == 0 else -1 - r.uid
                first.setdefault(uid, now)
                tokens += r.finish_reason != "stop"  # an EOS token is not part of the completion
                if r.finish_reason is not None:
                    live.discard(uid)
    seconds = time.perf_counter() - t0
    return Run(tokens, seconds, [(first[u] - t0) * 1000 for u in uids])


async def _text_rows(raw: _RawVision, cfg: BenchConfig, n: int) -> TextRows:
    """Text prompts at N on mlx-vlm's batch and on mlx-lm's, run by run in turn."""
    from mlxq.engine.core.prompt import encode_prompt

    prompts = [encode_prompt(raw.loaded.tokenizer, None, [{"role": "user", "content": TEXT.format(i=i)}])
               for i in range(n)]
    await raw.text_vlm(prompts, cfg.warmup_tokens)
    await raw.text_lm(prompts, cfg.warmup_tokens)
    vlm: list[Run] = []
    lm: list[Run] = []
    for _ in range(cfg.vision_repeats):
        time.sleep(SETTLE_S)
        vlm.append(await raw.text_vlm(prompts, cfg.max_tokens))
        time.sleep(SETTLE_S)
        lm.append(await raw.text_lm(prompts, cfg.max_tokens))
    v, m = PathResult.of(vlm), PathResult.of(lm)
    row = TextRows(n, v, m, paired_median(v.runs_tok_s, m.runs_tok_s))
    say(f"[{raw.name}] text rows N={n:<3} mlx-vlm {v.tok_s:8.1f} tok/s (runs {fmt_runs(v)}); "
         f"mlx-lm {m.tok_s:8.1f} tok/s (runs {fmt_runs(m)}); paired {row.vlm_over_lm_paired:.2f}")
    return row


async def _mixed_rows(raw: _RawVision, cfg: BenchConfig, n: int) -> MixedRows:
    """N/2 image jobs and N/2 text prompts at once: one mlx-vlm batch against text rows on mlx-lm."""
    from mlxq.engine.core.prompt import encode_prompt

    jobs = _jobs(max(1, n // 2))
    prompts = [encode_prompt(raw.loaded.tokenizer, None, [{"role": "user", "content": TEXT.format(i=i)}])
               for i in range(max(1, n - n // 2))]
    for split in (False, True):
        await raw.mixed(jobs, prompts, cfg.warmup_tokens, split)
    one: list[Run] = []
    two: list[Run] = []
    for _ in range(cfg.vision_repeats):
        time.sleep(SETTLE_S)
        one.append(await raw.mixed(jobs, prompts, cfg.max_tokens, False))
        time.sleep(SETTLE_S)
        two.append(await raw.mixed(jobs, prompts, cfg.max_tokens, True))
    a, b = PathResult.of(one), PathResult.of(two)
    row = MixedRows(len(jobs) + len(prompts), a, b, paired_median(a.runs_tok_s, b.runs_tok_s))
    say(f"[{raw.name}] mixed N={row.n:<3} one mlx-vlm batch {a.tok_s:8.1f} tok/s (runs {fmt_runs(a)}); text on "
         f"mlx-lm beside it {b.tok_s:8.1f} tok/s (runs {fmt_runs(b)}); paired {row.one_over_split_paired:.2f}")
    return row


# --- engine: the worker's model service in this process, without Redis ------------------------------------
class _EngineVision:
    """The worker's own ``ModelService`` (worker/service.py) in this process: its engine on an MLX thread of its
    own, its image thread, and each job prepared (worker/jobs/prepare.py) and added as the worker's run does;
    outputs timed where they leave the engine. The queue path minus the transport (client, Redis, the worker's
    event loop)."""

    def __init__(self, service: ModelService, clock: EngineClock) -> None:
        self.service = service
        self.clock = clock

    @classmethod
    async def start(cls, name: str, model: str, capacity: int) -> _EngineVision:
        from mlxq.worker.config import WorkerConfig
        from mlxq.worker.service import ModelService

        config = WorkerConfig(model=model, model_name=name, capacity=capacity)
        service, clock = ModelService(config.served[0], config), EngineClock()
        await service.load(clock.sink)
        return cls(service, clock)

    async def run(self, jobs: list[tuple[str, str]], max_tokens: int) -> Run:
        from mlxq.api.protocol.jobrecord import Envelope
        from mlxq.worker.jobs.prepare import prepare

        service = self.service
        assert service.engine is not None
        rids = self.clock.begin(len(jobs))
        t0 = time.perf_counter()
        service.engine.expect(len(jobs), service.config.admit_wait_ms / 1000)  # as the worker's claim does

        async def one(rid: str, text: str, url: str) -> None:  # a job's payload as the worker reads it
            payload = {"id": rid, "model": service.name, "messages": _messages(text, url), "max_tokens": max_tokens}
            prepared = await prepare(Envelope(payload, 0), rid, service.view, {})  # enqueued now
            service.add(prepared.request)

        await asyncio.gather(*(one(rid, text, url) for rid, (text, url) in zip(rids, jobs)))
        return await self.clock.end(t0, len(jobs))

    async def aclose(self) -> None:
        await self.service.aclose()


# --- queue: the worker serving the model ------------------------------------------------------------------
def _queue_phase(model: str, cfg: BenchConfig, site: Site, raw: _RawVision, extra_env: dict[str, str]
                 ) -> list[VisionRow]:
    prefix = f"mlxq-bench-vl-{uuid.uuid4().hex[:6]}"
    env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": raw.name, "MLXQ_REDIS_URL": site.url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(max(cfg.vision_concurrency)), **extra_env}
    log_path = site.out / "logs" / f"worker-{raw.name}.log"
    log_path.unlink(missing_ok=True)
    worker = WorkerProcess(env, log_path).start()
    try:
        worker.wait_ready()
        assert worker.proc is not None
        say(f"[{raw.name}] queue: worker ready (capacity {env['MLXQ_BATCH_CAPACITY']})")
        return asyncio.run(_drive(site.url, prefix, cfg, worker, raw))
    finally:
        worker.signal(signal.SIGCONT)
        worker.stop()


async def _drive(url: str, prefix: str, cfg: BenchConfig, worker: WorkerProcess, raw: _RawVision
                 ) -> list[VisionRow]:
    engine = await _EngineVision.start(raw.name, raw.path, raw.capacity)
    try:
        async with Client(url, prefix=prefix) as client:
            return [await _measure_at(client, worker, raw, engine, cfg, n) for n in cfg.vision_concurrency]
    finally:
        await engine.aclose()


async def _measure_at(client: Client, worker: WorkerProcess, raw: _RawVision, engine: _EngineVision,
                      cfg: BenchConfig, n: int) -> VisionRow:
    """Raw, engine and queue runs of N image jobs, alternating."""
    jobs = _jobs(n)
    r, e, q, _ = await alternate_runs(worker, cfg, cfg.vision_repeats_for(raw.name),
                                      functools.partial(raw.images, jobs), functools.partial(engine.run, jobs),
                                      functools.partial(run_queue, client, raw.name, jobs))
    say(f"[{raw.name}] images N={n:<3} raw {r.tok_s:8.1f} tok/s (runs {fmt_runs(r)}); "
         f"engine {e.tok_s:8.1f} tok/s (runs {fmt_runs(e)}); queue {q.tok_s:8.1f} tok/s (runs {fmt_runs(q)})")
    return VisionRow(n, r, e, q, safe_ratio(q.tok_s, r.tok_s), paired_median(q.runs_tok_s, r.runs_tok_s),
                     paired_median(e.runs_tok_s, r.runs_tok_s), paired_median(q.runs_tok_s, e.runs_tok_s))


async def run_queue(client: Client, model: str, jobs: list[tuple[str, str]], max_tokens: int) -> Run:
    """Submit every image job at once and follow each; first submit -> last terminal event."""
    t0 = time.perf_counter()
    traces = await asyncio.gather(*(_one(client, model, text, url, max_tokens) for text, url in jobs))
    end = max(e for _, e, _ in traces)
    return Run(sum(n for _, _, n in traces), end - t0, [(f - t0) * 1000 for f, _, _ in traces])


async def _one(client: Client, model: str, text: str, url: str, max_tokens: int) -> tuple[float, float, int]:
    first = ended = 0.0
    tokens = 0
    async for ev in client.submit_and_follow(model=model, messages=_messages(text, url), max_tokens=max_tokens,
                                             timeout=TIMEOUT_S):
        if ev.type == "token" and not first:
            first = time.perf_counter()
        elif isinstance(ev, DoneEvent):
            ended, tokens = time.perf_counter(), ev.usage.completion_tokens
        elif isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
    return first or ended, ended, tokens


# --- report ---------------------------------------------------------------------------------------------
def vision_targets(results: list[VisionResult]) -> list[Target]:
    """Image jobs: queue/raw >= 0.9 at every N (best runs and median of pairs) on the small qwen2_vl, whose
    steps cost what a real model's do; on the tiny one, whose steps are a millisecond of Python, the floor
    issue #3 gives the tiny text model for the same reason (0.8): there the ratio is the queue's fixed costs
    per job and per token against almost no model work (the engine column says how much is serving itself)."""
    out = []
    for result in results:
        floor = _TINY_FLOOR if result.name.startswith("tiny") else _FLOOR
        for r in result.rows:
            name = f"queue/raw images {result.name} N={r.n}"
            out.append(Target(f"{name} (best runs)", r.queue_over_raw, f">= {floor:g}", r.queue_over_raw >= floor))
            out.append(Target(f"{name} (median of pairs)", r.queue_over_raw_paired, f">= {floor:g}",
                              r.queue_over_raw_paired >= floor))
    return out


def md_vision(results: list[VisionResult] | None, cfg: BenchConfig) -> list[str]:
    """The image sections of results.md, one per model."""
    return [line for result in results or [] for line in _md_model(result, cfg)]


def _md_model(result: VisionResult, cfg: BenchConfig) -> list[str]:
    w, h = result.image_size
    blas = f"OpenBLAS {result.blas_threads} thread" if result.blas_threads else "the default BLAS threads"
    lines = [f"## Image jobs ({result.name}: a generated qwen2_vl, mlx-vlm)", "",
             f"One {w}x{h} PNG per job (a data URL) plus a line of text, greedy, max_tokens {cfg.max_tokens}; "
             f"{blas} on every path. raw = mlx-vlm's BatchGenerator in this process, each request's image decoded, "
             "processed and embedded before its insert (what serving it takes), then stepped to the end; engine = "
             "the worker's own model service in this process (its engine on an MLX thread of its own, its image "
             "thread; each job validated, prepared and added as the worker does), outputs timed where they leave "
             "the engine: engine/raw is what serving adds in the process (scheduler, detokenizers, pacer, the "
             "image thread's hand-offs), queue/engine the transport; queue = client -> Redis -> the worker -> the "
             f"client. Best of {cfg.vision_repeats_for(result.name)} alternating runs (raw, engine, queue); paired "
             "= median of each run's ratio to the run before it.", "",
             "| N | raw tok/s | engine tok/s | queue tok/s | queue/raw | queue/raw paired | engine/raw paired "
             "| queue/engine paired | TTFT p50 ms raw / engine / queue |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        lines.append(f"| {r.n} | {r.raw.tok_s:.1f} | {r.engine.tok_s:.1f} | {r.queue.tok_s:.1f} "
                     f"| {r.queue_over_raw:.2f} | {r.queue_over_raw_paired:.2f} | {r.engine_over_raw_paired:.2f} "
                     f"| {r.queue_over_engine_paired:.2f} | {r.raw.ttft_p50_ms:.1f} / {r.engine.ttft_p50_ms:.1f} "
                     f"/ {r.queue.ttft_p50_ms:.1f} |")
    lines += ["", "Text rows of the vision-language worker: text prompts on the same checkpoint through mlx-vlm's "
              "BatchGenerator (rows carrying embeddings, as the worker runs them) and through mlx-lm's (its own "
              "qwen2_vl text model), in this process, alternating. The worker keeps them in the mlx-vlm batch, "
              "beside image rows.", "",
              "| N | mlx-vlm tok/s | mlx-lm tok/s | mlx-vlm/mlx-lm paired |", "|---:|---:|---:|---:|"]
    lines += [f"| {t.n} | {t.vlm.tok_s:.1f} | {t.lm.tok_s:.1f} | {t.vlm_over_lm_paired:.2f} |"
              for t in result.text_rows]
    m = result.mixed
    lines += ["", f"A mixed load, {m.n} at once (half image jobs, half text): one mlx-vlm batch "
              f"{m.one_batch.tok_s:.1f} tok/s; image rows on mlx-vlm with the text rows on mlx-lm beside them (both "
              f"stepped every step) {m.split.tok_s:.1f} tok/s; paired {m.one_over_split_paired:.2f}."]
    return [*lines, ""]
