"""KV cache quantization inside the continuous batch (``MLXQ_KV_BITS``) against the float cache, side by side in one
run on a generated model, the engine's scheduler and batch in this process (no Redis: the queue costs the same
with and without it):

- **bytes**: KV bytes per token as the engine measures them (``measure_layout``: the buffers' allocation) against
  the formula 2 x layers x kv_heads x head_dim x b, with b the dtype's bytes, or bits/8 plus a scale and a bias
  per group (8 bits, groups of 64, a 2-byte dtype: 1.0625; 4 bits: 0.5625). Target: within 2 %;
- **rows**: rows the same KV headroom admits (``KVBudget``), quantized ÷ float, against the bytes' ratio (1.88x
  at 8 bits, 3.56x at 4, for a 2-byte dtype). Target: ≥ 0.95 of it;
- **throughput**: a burst of jobs through the scheduler with that headroom, sized so the float cache is full
  (``rows`` float rows fit): tok/s with 8 bits ÷ float (more rows at once). Target: ≥ 1.3x;
- **step**: a decode step's time per row at the float run's N, quantized ÷ float (the unfused quantized attention
  against MLX's fused one). Target: ≤ 1.25x. Beside it, what of a step is attention: the median step less the
  median step of the same batch with the model's attention left out (the cache still written and read at one
  element; blocks of each kind in turn);
- **quality**: the quantized cache's next-token distributions against the float one's over a few hundred
  positions of text (teacher-forced): mean KL(float ‖ quantized) and top-1 agreement, per bits.

Throughput and step are measured ``--pairs`` times, float and quantized sides alternating (the order reversed every
other pair); the targets' ratios are the medians of the pairs' own ratios (``--clock cpu``: the process's CPU time,
for a machine shared with other work).

``python3 -m tests.perf.kvquant --out DIR`` writes ``kvquant.md`` and ``kvquant.json`` (``--quick``: the tiny
kvq model, a few jobs; ``--device gpu`` on a machine with one). CPU figures are a proxy: there attention is
compute-bound, where on a GPU decoding reads the cache (what quantization shrinks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

__all__ = ["main"]

BYTES_TOLERANCE = 0.02
ROWS_TARGET = 0.95  # of the bytes' ratio
TPS_TARGET = 1.3  # 8 bits ÷ float, at the float cache's full N
STEP_TARGET = 1.25  # a decode step per row, quantized ÷ float
BITS = (8, 4)
BLOCK = 4  # timed steps in a row of one kind (whole, or without attention)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run does."""

    size: str = "small"
    dtype: str = "bfloat16"
    device: str = "cpu"
    rows: int = 8  # float rows the headroom holds
    prompt: int = 96
    max_tokens: int = 64
    jobs: int = 32  # in the throughput burst
    steps: int = 16  # timed decode steps
    positions: int = 320  # of the quality measure
    group_size: int = 64
    pairs: int = 1  # throughput and step measures, the sides alternating
    clock: str = "wall"  # or "cpu": the process's CPU time

    @classmethod
    def quick(cls) -> Plan:
        return cls(size="tiny-kvq", dtype="float16", rows=4, prompt=24, max_tokens=12, jobs=8, steps=4, positions=96)


@dataclass
class Side:
    """One cache kind's figures (``bits`` 0: float)."""

    bits: int
    bytes_per_token: int
    formula: float
    rows: int  # at the plan's headroom
    tps: float = 0.0
    step_ms_per_row: float = 0.0
    mean_kl: float = 0.0
    top1: float = 1.0
    attention_ms_per_row: float = 0.0  # of a step's time per row: the model's attention (the median of its pairs)
    tps_runs: list[float] = field(default_factory=list)  # each pair's
    step_runs: list[float] = field(default_factory=list)

    @property
    def bytes_error(self) -> float:
        return abs(self.bytes_per_token - self.formula) / self.formula


@dataclass
class Results:
    plan: Plan
    blas: str
    sides: list[Side] = field(default_factory=list)
    # the float cache in the plan's dtype against the same weights in float32: the dtype's own KL and top-1, beside
    # which the quantized cache's are read
    floor: tuple[float, float] = (0.0, 1.0)

    def side(self, bits: int) -> Side:
        (s,) = [s for s in self.sides if s.bits == bits]
        return s

    def paired(self, bits: int, what: str) -> float:
        """``what`` ("tps" or "step") of ``bits`` ÷ float's: the median of the pairs' own ratios (one pair: the
        medians' ratio)."""
        f, q = self.side(0), self.side(bits)
        runs = list(zip(getattr(f, f"{what}_runs"), getattr(q, f"{what}_runs")))
        if len(runs) > 1 and all(a > 0 for a, _ in runs):
            return statistics.median(b / a for a, b in runs)
        mine, theirs = (q.tps, f.tps) if what == "tps" else (q.step_ms_per_row, f.step_ms_per_row)
        return mine / theirs if theirs else 0.0

    def rows_ratio(self, bits: int) -> tuple[float, float]:
        """Rows admitted, quantized ÷ float, and the bytes' ratio it is held to."""
        f, q = self.side(0), self.side(bits)
        return q.rows / f.rows, f.formula / q.formula

    def targets(self) -> list[tuple[str, str, str, bool]]:
        """(what, value, target, passed) for each target."""
        out = []
        for s in self.sides:
            name = f"{s.bits} bits" if s.bits else "float"
            out.append((f"KV bytes a token, {name}: measured against the formula ({s.formula:g})",
                        f"{s.bytes_per_token} ({s.bytes_error:.1%})", f"≤ {BYTES_TOLERANCE:.0%}",
                        s.bytes_error <= BYTES_TOLERANCE))
        for bits in BITS:
            got, ideal = self.rows_ratio(bits)
            out.append((f"rows at the same headroom, {bits} bits ÷ float", f"{got:.2f}x",
                        f"≥ {ROWS_TARGET:g} x {ideal:.2f}x", got >= ROWS_TARGET * ideal))
        f = self.side(0)
        tps, step = self.paired(8, "tps"), self.paired(8, "step")
        out.append((f"tok/s at the float cache's full N ({f.rows}), 8 bits ÷ float", f"{tps:.2f}x",
                    f"≥ {TPS_TARGET:g}x", tps >= TPS_TARGET))
        out.append((f"a decode step per row at N={f.rows}, 8 bits ÷ float", f"{step:.2f}x", f"≤ {STEP_TARGET:g}x",
                    0 < step <= STEP_TARGET))
        return out


class Bench:
    """The model loaded once on its own stream; every measure runs the engine's batch and scheduler."""

    def __init__(self, plan: Plan) -> None:
        import mlx.core as mx

        from mlxq.engine.mlx.loader import load_model
        from mlxq.worker.tools.tinymodel import corpus, ensure_model

        self.plan = plan
        self.stream = mx.new_stream(mx.cpu if plan.device == "cpu" else mx.default_device())
        with mx.stream(self.stream):
            loaded = load_model(str(ensure_model(plan.size)))
            loaded.model.set_dtype(getattr(mx, plan.dtype))
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        need = plan.positions + plan.prompt * plan.jobs // 4  # the prompts overlap by three quarters at most
        self.text = list(self.tokenizer.encode(" ".join(corpus(7, n_lines=max(400, need // 8)))))
        assert len(self.text) >= need, "the corpus is too short"
        self.clock: Callable[[], float] = time.process_time if plan.clock == "cpu" else time.perf_counter

    def quant(self, bits: int) -> Any:
        from mlxq.engine.mlx.quantized_cache import KVQuant

        return KVQuant(bits, self.plan.group_size) if bits else None

    def prompts(self, n: int) -> list[list[int]]:
        """``n`` prompts of the plan's length, each from another place of the text (ignoring EOS: all run long)."""
        p = self.plan.prompt
        return [self.text[(i * 37) % (len(self.text) - p):][:p] for i in range(n)]

    def layout(self, bits: int) -> Any:
        import mlx.core as mx

        from mlxq.engine.mlx.memory import measure_layout

        with mx.stream(self.stream):
            return measure_layout(self.model, 512, self.quant(bits))

    def formula(self, bits: int) -> float:
        """2 x layers x kv_heads x head_dim x bytes a value, from the float cache's shapes after one token."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        with mx.stream(self.stream):
            self.model(mx.array([[0]]), cache=cache)
        keys = [cast(mx.array, c.keys) for c in cache if type(c) is KVCache]
        values = sum(2 * k.shape[1] * k.shape[3] for k in keys)
        size = keys[0].dtype.size
        return float(values * (self.quant(bits).value_bytes(size) if bits else size))

    def batch(self, bits: int, capacity: int) -> Any:
        """The engine's batch, without end-of-sequence tokens: every job runs to its max_tokens."""
        from mlxq.engine.mlx.batch import MLXBatch

        return MLXBatch(self.model, (), capacity=capacity, prefill_batch_size=8, prefill_step_size=512,
                        stream=self.stream, kv_quant=self.quant(bits))

    def burst(self, bits: int, headroom: int, layout: Any) -> float:
        """tok/s of the plan's jobs through a scheduler admitting by ``headroom`` (slots are not the bound)."""
        import mlx.core as mx

        from mlxq.engine.core.memory import KVBudget
        from mlxq.engine.core.request import EngineRequest, SamplingParams
        from mlxq.engine.core.scheduler import Scheduler

        plan = self.plan
        cap = 8 * plan.rows
        s = Scheduler(self.batch(bits, cap), capacity=cap, new_detokenizer=lambda: self.tokenizer.detokenizer,
                      memory=KVBudget(headroom, layout))
        for i, p in enumerate(self.prompts(plan.jobs)):
            s.add(EngineRequest(f"j{i}", p, SamplingParams(max_tokens=plan.max_tokens)))
        tokens, t0 = 0, self.clock()
        with mx.stream(self.stream):
            while s.has_work:
                tokens += sum(len(o.token_ids) for o in s.step())
        return tokens / (self.clock() - t0)

    def step_ms_per_row(self, bits: int, n: int) -> tuple[float, float]:
        """A decode step's time over ``n`` rows that all decode (after their prefill), per row, and of it the
        model's attention: the median step, less the median step of the same batch run on without attention (its
        tokens do not matter: every row runs on). mlx-lm's generator evaluates a step while the next call builds
        the one after, so a call's time is the step the call before built: the first of each block is not
        counted."""
        import mlx.core as mx

        rounds = max(1, self.plan.steps // BLOCK)
        b = self.batch(bits, n)
        with mx.stream(self.stream):
            for p in self.prompts(n):
                b.insert(p, 2 * rounds * (BLOCK + 1) + 8, None, [])
            started: set[int] = set()
            while len(started) < n:
                started.update(t.uid for t in b.step())
            whole: list[float] = []
            without: list[float] = []
            for _ in range(rounds):  # blocks of each kind in turn, so a machine's drift falls on both
                whole += self._block(b)
                with attention_left_out(self.model):
                    without += self._block(b)
        b.close()
        step = statistics.median(whole)
        return 1000 * step / n, 1000 * (step - statistics.median(without)) / n

    def _block(self, b: Any) -> list[float]:
        """:data:`BLOCK` steps' times, after one untimed (whose time is the step built before the block)."""
        return [self._timed(b.step) for _ in range(BLOCK + 1)][1:]

    def _timed(self, fn: Callable[[], object]) -> float:
        t0 = self.clock()
        fn()
        return self.clock() - t0

    def quality(self, bits: int) -> tuple[float, float]:
        """Mean KL(float ‖ quantized) of the next-token distributions, and top-1 agreement, teacher-forced over the
        plan's positions of text (one pass each: the quantized cache attends through what it quantized)."""
        return _compare(self.logprobs(None), self.logprobs(self.quant(bits)))

    def floor(self) -> tuple[float, float]:
        """The same comparison for the float cache in the plan's dtype against the weights run in float32."""
        import mlx.core as mx

        ours = self.logprobs(None)
        self.model.set_dtype(mx.float32)
        try:
            return _compare(self.logprobs(None), ours)
        finally:
            self.model.set_dtype(getattr(mx, self.plan.dtype))

    def logprobs(self, quant: Any) -> Any:
        import mlx.core as mx

        from mlxq.engine.mlx.quantized_cache import make_cache

        tokens = mx.array(self.text[:self.plan.positions])[None]
        with mx.stream(self.stream):
            out = self.model(tokens, cache=make_cache(self.model, quant)).astype(mx.float32)[0]
            out = out - mx.logsumexp(out, -1, keepdims=True)
            mx.eval(out)
        return out


def _no_attention(queries: Any, keys: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
    """A layer's attention left out: the queries as its output, after reading each cache array at one element (so
    the step still writes and evaluates the cache, quantized or not)."""
    import mlx.core as mx

    parts = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
    touched = sum((p[..., -1:, :1].astype(mx.float32).sum() for p in parts), mx.array(0.0))
    return queries + (touched * 0).astype(queries.dtype)


@contextmanager
def attention_left_out(model: Any) -> Iterator[None]:
    """``model``'s layers call :func:`_no_attention` for mlx-lm's ``scaled_dot_product_attention`` (the name each
    model module imports from mlx_lm.models.base) while inside."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    patched = [(m, m.scaled_dot_product_attention) for m in modules if hasattr(m, "scaled_dot_product_attention")]
    assert patched, "the model's modules do not call mlx-lm's scaled_dot_product_attention"
    for m, _ in patched:
        m.scaled_dot_product_attention = _no_attention  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, fn in patched:
            m.scaled_dot_product_attention = fn  # type: ignore[attr-defined]


def _compare(ref: Any, got: Any) -> tuple[float, float]:
    """Mean KL(ref ‖ got) of two runs' log-probabilities, and how often their argmax agrees."""
    import mlx.core as mx

    kl = mx.mean(mx.sum(mx.exp(ref) * (ref - got), axis=-1))
    top1 = mx.mean((mx.argmax(ref, -1) == mx.argmax(got, -1)).astype(mx.float32))
    return float(cast(float, kl.item())), float(cast(float, top1.item()))


def run(plan: Plan) -> Results:
    """Every measure, float and each bits side by side, the float run first at each."""
    from mlxq.worker.tools.blas import blas_of

    bench = Bench(plan)
    layouts = {bits: bench.layout(bits) for bits in (0, *BITS)}
    length = plan.prompt + plan.max_tokens
    headroom = plan.rows * layouts[0].row_bytes(length)  # the float cache holds ``rows`` rows, no more
    from mlxq.engine.core.memory import KVBudget

    result = Results(plan, blas_of(), floor=bench.floor() if plan.dtype != "float32" else (0.0, 1.0))
    for bits in (0, *BITS):
        rows = KVBudget(headroom, layouts[bits]).rows_that_fit(length, 0)
        result.sides.append(Side(bits, layouts[bits].bytes_per_token, bench.formula(bits), rows))
    attention: dict[int, list[float]] = {side.bits: [] for side in result.sides}
    for i in range(plan.pairs):  # float, 8, 4, each at the same headroom; then 4, 8, float
        for side in result.sides if i % 2 == 0 else result.sides[::-1]:
            side.tps_runs.append(bench.burst(side.bits, headroom, layouts[side.bits]))
            step, attn = bench.step_ms_per_row(side.bits, plan.rows)
            side.step_runs.append(step)
            attention[side.bits].append(attn)
            print(f"pair {i + 1}, kv bits {side.bits or 'float'}: {side.rows} rows, {side.tps_runs[-1]:.1f} tok/s, "
                  f"{step:.3f} ms a row-step ({attn:.3f} attention)", flush=True)
    for side in result.sides:
        side.tps, side.step_ms_per_row = statistics.median(side.tps_runs), statistics.median(side.step_runs)
        side.attention_ms_per_row = statistics.median(attention[side.bits])
        if side.bits:
            side.mean_kl, side.top1 = bench.quality(side.bits)
            print(f"kv bits {side.bits}: KL {side.mean_kl:.2e}, top-1 {side.top1:.3f}", flush=True)
    return result


def markdown(r: Results) -> str:
    p = r.plan
    lines = ["# KV cache quantization in the batch", "",
             f"Model `{p.size}` in {p.dtype} on MLX's {p.device}, BLAS {r.blas}; groups of {p.group_size}. Headroom: "
             f"{p.rows} float rows of {p.prompt} + {p.max_tokens} tokens; {p.jobs} jobs a burst (EOS ignored); "
             f"decode steps timed over {p.steps} steps at N={p.rows}; {p.pairs} pair(s) of runs, sides alternating, "
             f"{p.clock} time; quality over {p.positions} positions. The float cache in {p.dtype} against float32 "
             f"(the dtype's own error): mean KL {r.floor[0]:.2e}, top-1 {r.floor[1]:.3f}.", "",
             "| cache | bytes/token | formula | rows | tok/s | ms a row-step | of it attention | mean KL | top-1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in r.sides:
        quality = (f"{s.mean_kl:.2e} | {s.top1:.3f}" if s.bits else "- | -")
        lines.append(f"| {f'{s.bits} bits' if s.bits else 'float'} | {s.bytes_per_token} | {s.formula:g} | {s.rows} | "
                     f"{s.tps:.1f} | {s.step_ms_per_row:.3f} | {s.attention_ms_per_row:.3f} | {quality} |")
    lines += ["", "## Targets", "", "| what | value | target | |", "|---|---|---|---|"]
    lines += [f"| {what} | {value} | {target} | {'PASS' if ok else 'MISS'} |"
              for what, value, target, ok in r.targets()]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.kvquant", description=__doc__)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true", help="the tiny kvq model, a few jobs (a smoke run)")
    ap.add_argument("--size", default=None, help="a generated model size (default: small)")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: bfloat16)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--rows", type=int, default=None, help="float rows the headroom holds (default: 8)")
    ap.add_argument("--prompt", type=int, default=None, help="tokens a prompt (default: 96)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens each job generates (default: 64)")
    ap.add_argument("--pairs", type=int, default=1, help="throughput and step runs, sides alternating (default: 1)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or the process's CPU time (a machine shared with other work)")
    ap.add_argument("--no-reexec", action="store_true", help="run with whatever BLAS this process has")
    args = ap.parse_args(argv)
    if args.device == "gpu" and not _has_gpu():
        print("python3 -m tests.perf.kvquant: --device gpu, but MLX has no GPU here (mlx[cuda] on Linux, Metal on a "
              "Mac)", file=sys.stderr)
        return 2
    if not args.no_reexec:
        from mlxq.worker.tools.bench.preload import reexec_with_openblas

        reexec_with_openblas(["-m", "tests.perf.kvquant", *(argv if argv is not None else sys.argv[1:])])
    plan = Plan.quick() if args.quick else Plan()
    changes = {k: v for k, v in (("size", args.size), ("dtype", args.dtype), ("rows", args.rows),
                                 ("prompt", args.prompt), ("max_tokens", args.max_tokens)) if v}
    plan = Plan(**{**asdict(plan), **changes, "device": args.device, "pairs": max(1, args.pairs),
                   "clock": args.clock})
    result = run(plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    (out / "kvquant.md").write_text(text)
    data = asdict(result)
    data["targets"] = [dict(zip(("what", "value", "target", "passed"), t)) for t in result.targets()]
    (out / "kvquant.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


def _has_gpu() -> bool:
    import mlx.core as mx

    return bool(mx.is_available(mx.gpu))


if __name__ == "__main__":
    sys.exit(main())
