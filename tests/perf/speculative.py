"""Speculative decoding in the batch against plain decoding, on a generated target/draft pair whose acceptance is
measured: tok/s at each N with the tuner choosing k, with each k fixed, the pair's acceptance alpha, the draft's
cost ratio c, and the ideal speedup for them; prompt lookup's overhead on text that never repeats. Fully loaded
(N requests kept in flight), speculation must never be slower than plain decoding: plain and speculative runs
alternate in pairs, and the median of the pairs' ratios is set beside that target with a PASS/MISS verdict.

``python3 -m tests.perf.speculative --out DIR`` writes ``speculative.md`` and ``speculative.json``. The engine's
batch runs in this process on one MLX thread (no Redis: the queue adds the same cost with and without it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxq.worker.tools.bench.preload import reexec_with_openblas
from mlxq.worker.tools.bench.runs import say
from mlxq.worker.tools.blas import blas_of
from tests.perf.speculative_copying import copy_task

WORDS = ("the", "sea", "ship", "story", "numbers", "words", "fox", "quick", "brown", "red", "blue", "river", "stone",
         "light", "over", "under", "and", "with", "from", "into", "a", "an", "of", "to")


@dataclass
class Row:
    n: int
    plain_tps: float
    spec_tps: float  # the tuner choosing k
    k_used: dict[int, int]  # steps per k in the tuner's timed run
    fixed: dict[int, float]  # tok/s with k fixed
    taken: float  # proposals taken / proposed, in the tuner's run
    k: int  # the k the tuner used most
    alpha: float  # per-position acceptance that explains ``taken`` at that k (i.i.d.: E[kept] = sum alpha^j)
    c: float  # a draft step's time / a target step's, at this N
    verify: float  # a target pass over k + 1 positions / a target step, at this N

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps

    def ideal(self, verify: float = 1.0) -> float:
        """The usual bound: expected tokens per step over the step's cost in target steps (k drafts at c each,
        one verification at ``verify`` target steps; the usual formula counts it as one)."""
        if not self.k:
            return 1.0
        a, k = self.alpha, self.k
        return (1 - a ** (k + 1)) / ((1 - a) * (k * self.c + verify))


@dataclass
class Report:
    blas: str
    pair_alpha: float  # per-token agreement of draft and target along the target's greedy text
    max_tokens: int
    rows: list[Row] = field(default_factory=list)
    ngram_overhead: dict[int, float] = field(default_factory=dict)  # N -> lookup tok/s / plain tok/s
    loaded: dict[int, tuple[float, float]] = field(default_factory=dict)  # N -> plain, speculative tok/s, full load
    # N -> (plain, speculative) tok/s of each pair of fully loaded runs, run one after the other
    loaded_pairs: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    # N -> the median of the pairs' speculative ÷ plain tokens per second of the process's CPU time: on a machine
    # shared with other work, steadier than wall time (no target: a GPU's steps are not the CPU's)
    loaded_cpu: dict[int, float] = field(default_factory=dict)
    # N -> distinct shapes of attention over several positions in the fully loaded runs: the speculative batch's
    # passes by kind (verify, draft, draft-prefill), and every attention call's (q, k, mask) in the plain and the
    # speculative runs (the target's prefill chunks included); on CUDA each new one builds a cuDNN graph
    loaded_shapes: dict[int, dict[str, int]] = field(default_factory=dict)
    fixed_shapes: bool = False  # whether the batch kept its shapes repeating (on by default on CUDA only)
    copying: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # N -> plain, lookup tok/s, taken
    pair: Pair = field(default_factory=lambda: Pair())


NEVER_SLOWER = 0.97  # fully loaded, speculative ÷ plain tok/s (the median of paired runs): never slower, but noise


def loaded_ratio(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of paired runs' speculative ÷ plain tok/s."""
    return statistics.median(q / p for p, q in pairs)


def verdict(ratio: float) -> str:
    return "PASS" if ratio >= NEVER_SLOWER else "MISS"


@dataclass(frozen=True)
class Pair:
    """The generated draft/target pair and where it runs: ``shape`` "small" (the pair the CPU figures use), or
    "HIDDENxLAYERS" (e.g. 4096x32: an 8 B-class target, its draft one layer of the same width), in ``dtype``, on
    MLX's CPU or its default device (a GPU where there is one: a memory-bound step, as on a Mac)."""

    shape: str = "small"
    dtype: str = "float32"
    device: str = "cpu"
    repeat_shapes: bool | None = None  # the batch's shapes kept repeating (None: MLX's choice, on CUDA only)

    def sizes(self) -> tuple[str, str]:
        """The draft's and the target's names in tinymodel's SIZES (registered here for a custom shape)."""
        if self.shape == "small":
            return "small-draft", "small-target"
        import dataclasses

        from mlxq.worker.tools.tinymodel import SIZES

        hidden, layers = (int(x) for x in self.shape.split("x"))
        heads = max(4, hidden // 128)
        base = dataclasses.replace(SIZES["small"], hidden_size=hidden, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), intermediate_size=hidden * 43 // 16)
        draft, target = f"spec-{self.shape}-draft", f"spec-{self.shape}-target"
        SIZES[draft] = dataclasses.replace(base, name=draft, num_hidden_layers=1)
        SIZES[target] = dataclasses.replace(base, name=target, num_hidden_layers=layers, grows=draft, growth=0.03)
        return draft, target


class Bench:
    """The pair loaded once; bursts of N greedy requests through the engine's scheduler and batch."""

    def __init__(self, max_tokens: int, pair: Pair | None = None) -> None:
        import mlx.core as mx
        import mlx_lm

        from mlxq.worker.tools.tinymodel import ensure_model

        pair = pair or Pair()
        draft, target = pair.sizes()
        self.target = mlx_lm.load(str(ensure_model(target)))
        self.draft = mlx_lm.load(str(ensure_model(draft)))
        if pair.dtype != "float32":
            for loaded in (self.target, self.draft):
                loaded[0].set_dtype(getattr(mx, pair.dtype))
        self.stream = mx.new_stream(mx.cpu if pair.device == "cpu" else mx.default_device())
        self.max_tokens = max_tokens
        self.repeat_shapes = pair.repeat_shapes
        self.ks: Counter[int] = Counter()  # the last fully loaded run's steps of each k
        self.cpu_tps = 0.0  # and its tokens per second of this process's CPU time (all its threads)

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        import random

        rng = random.Random(seed)
        tok = self.target[1]
        return [tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))) for _ in range(n)]

    def batch(self, kind: str | None, n: int, model: Any = None) -> Any:
        """The engine's batch over the target (or ``model``), with the draft (``"draft"``), prompt lookup
        (``"ngram"``) or no proposer."""
        from mlxq.engine.core.stats import EngineStats
        from mlxq.engine.mlx.batch import MLXBatch
        from mlxq.engine.mlx.speculation.proposers import DraftModel, PromptLookup

        proposer = DraftModel(self.draft[0], 512) if kind == "draft" else PromptLookup() if kind == "ngram" else None
        return MLXBatch(self.target[0] if model is None else model, self.target[1].eos_token_ids,
                        capacity=max(n, 1), prefill_batch_size=8, prefill_step_size=512, stream=self.stream,
                        proposer=proposer, stats=EngineStats(), fixed_shapes=self.repeat_shapes)

    def run(self, batch: Any, n: int, seed: int) -> tuple[float, Counter[int]]:
        """Decode tok/s of one burst of ``n`` of the bench's prompts, and the steps of each k."""
        return self.burst(batch, self.prompts(n, seed))

    def burst(self, batch: Any, prompts: list[list[int]]) -> tuple[float, Counter[int]]:
        """Decode tok/s of one burst of ``prompts`` (from the first generated token on), and the steps of each k."""
        import mlx.core as mx

        ks: Counter[int] = Counter()
        with mx.stream(self.stream):
            for p in prompts:
                batch.insert(p, self.max_tokens, None, [])
            left, tokens, start = len(prompts), 0, 0.0
            while left:
                out = batch.step()
                if out and not start:
                    start = time.perf_counter()
                    continue
                tokens += len(out)
                left -= sum(1 for t in out if t.finish_reason)
                if batch._spec is not None and out:
                    ks[batch._spec.stats.spec_k] += 1
        return tokens / (time.perf_counter() - start), ks

    def load(self, batch: Any, n: int, seed: int, rounds: int = 3,
             shapes: dict[str, set[tuple[Any, ...]]] | None = None) -> float:
        """Decode tok/s of a fully loaded batch: ``n`` requests in flight, each one that ends replaced, until
        ``rounds * n`` were sent; timed from the first token to the last replacement (no burst's tail, where
        rows that speculation sped up unevenly leave a few behind). The shapes of attention over several
        positions met go in ``shapes`` (see :func:`watching`)."""
        with watching(batch, shapes if shapes is not None else {}):
            return self._load(batch, n, seed, rounds)

    def _load(self, batch: Any, n: int, seed: int, rounds: int) -> float:
        import mlx.core as mx

        prompts = self.prompts(rounds * n, seed)
        self.ks = Counter[int]()  # steps of each k, timed ones
        with mx.stream(self.stream):
            for p in prompts[:n]:
                batch.insert(p, self.max_tokens, None, [])
            sent, ended, tokens, start, elapsed, cpu = n, 0, 0, 0.0, 0.0, 0.0
            while ended < len(prompts):
                out = batch.step()
                done = sum(1 for t in out if t.finish_reason)
                ended += done
                if sent == len(prompts):  # the tail: drained, not timed
                    continue
                if out and not start:
                    start, cpu = time.perf_counter(), time.process_time()
                    continue
                tokens += len(out)
                if batch._spec is not None and out:
                    self.ks[batch._spec.stats.spec_k] += 1
                for _ in range(min(done, len(prompts) - sent)):
                    batch.insert(prompts[sent], self.max_tokens, None, [])
                    sent += 1
                if sent == len(prompts):
                    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.cpu_tps = tokens / cpu
        return tokens / elapsed


@contextlib.contextmanager
def watching(batch: Any, shapes: dict[str, set[tuple[Any, ...]]]) -> Iterator[None]:
    """Collect, while it runs, the shapes of every attention over several query positions (``"attention"``: q, k
    and mask, the target's prefill chunks included) and of the speculative batch's passes by kind."""
    import mlx.core as mx

    attention, spec = mx.fast.scaled_dot_product_attention, batch._spec

    def recording(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        if q.shape[2] > 1:
            mask = kwargs.get("mask")
            shapes.setdefault("attention", set()).add((q.shape, k.shape, getattr(mask, "shape", mask)))
        return attention(q, k, v, **kwargs)

    mx.fast.scaled_dot_product_attention = recording
    if spec is not None:
        saw_before = spec.saw

        def saw(kind: str, *shape: int) -> None:
            shapes.setdefault(kind, set()).add(shape)
            saw_before(kind, *shape)

        spec.saw = saw
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = attention
        if spec is not None:
            del spec.saw


def pair_alpha(bench: Bench) -> float:
    """How often the draft's greedy token is the target's along the target's own greedy text."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    agree = total = 0
    for prompt in bench.prompts(4, seed=99):
        out = [int(t) for t, _ in generate_step(mx.array(prompt), bench.target[0], max_tokens=bench.max_tokens)]
        seq = prompt + out
        guess = mx.argmax(bench.draft[0](mx.array(seq)[None])[0], axis=-1).tolist()
        agree += sum(guess[i - 1] == seq[i] for i in range(len(prompt), len(seq)))  # type: ignore[index]
        total += len(out)
    return agree / total


def per_position(taken: float, k: int) -> float:
    """The alpha with (alpha + ... + alpha^k) / k = ``taken`` (bisection): the i.i.d. acceptance behind a rate."""
    lo, hi = 0.0, 0.999999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(1, k + 1)) / k < taken else (lo, mid)
    return lo


def step_cost(model: Any, n: int, width: int = 1) -> float:
    """Median seconds of one pass of ``n`` rows over ``width`` positions, 128 tokens into their caches."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((n, 128), dtype=mx.uint32), cache=cache))
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        mx.eval(model(mx.zeros((n, width), dtype=mx.uint32), cache=cache))
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(width)
    return statistics.median(times)


def measure(sizes: Sequence[int], max_tokens: int, fixed: Sequence[int], repeats: int,
            pair: Pair | None = None, loaded_pairs: int = 3, loaded_only: bool = False) -> Report:
    # A wrapper may patch Bench.__init__(self, max_tokens) to put the default pair elsewhere (a GPU run's does)
    bench = Bench(max_tokens) if pair is None or pair == Pair() else Bench(max_tokens, pair)
    report = Report(blas_of(), pair_alpha(bench), max_tokens, pair=pair or Pair())
    say(f"pair: alpha {report.pair_alpha:.2f} along the target's greedy text; BLAS {report.blas}")
    for n in sizes:
        plain, spec = bench.batch(None, n), bench.batch("draft", n)
        bench.run(plain, n, seed=1)  # first use of the plain batch's shapes (kernels compiled, graphs built)
        bench.run(spec, n, seed=1)  # the tuner learns this batch size (a worker's would have)
        if not loaded_only:
            report.rows.append(bursts(bench, plain, spec, n, fixed, repeats))
        fully_loaded(bench, report, plain, spec, n, loaded_pairs)
        if loaded_only:
            continue
        lookup = bench.batch("ngram", n)
        bench.run(lookup, n, seed=1)
        ngram = max(bench.run(lookup, n, seed=10 + r)[0] for r in range(repeats))
        report.ngram_overhead[n] = ngram / report.rows[-1].plain_tps
    if not loaded_only:
        report.copying = copy_task(bench, sizes, repeats)
    return report


def bursts(bench: Bench, plain: Any, spec: Any, n: int, fixed: Sequence[int], repeats: int) -> Row:
    """Bursts of ``n`` requests, plain and speculative alternated (the best of each: background load only slows a
    run), and with each k of ``fixed`` held."""
    plains, specs, ks = [], [], Counter[int]()
    for r in range(repeats):
        plains.append(bench.run(plain, n, seed=10 + r)[0])
        stats = spec._spec.stats
        drafted, accepted = stats.spec_drafted, stats.spec_accepted
        tps, used = bench.run(spec, n, seed=10 + r)
        specs.append(tps)
        ks += used
    taken = (stats.spec_accepted - accepted) / max(1, stats.spec_drafted - drafted)
    most = max((k for k in ks if k), key=lambda k: ks[k], default=0)
    fixed_tps = {}
    for kf in fixed:
        one = bench.batch("draft", n)
        one._spec.tuner.choose = lambda rows, kf=kf: kf  # type: ignore[method-assign]
        bench.run(one, n, seed=1)  # first use of its shapes (kernels compiled, graphs built), as the tuner's had
        fixed_tps[kf] = max(bench.run(one, n, seed=20 + i)[0] for i in range(repeats))
    target = step_cost(bench.target[0], n)
    c = step_cost(bench.draft[0], n) / target
    verify = step_cost(bench.target[0], n, most + 1) / target if most else 1.0
    row = Row(n, max(plains), max(specs), dict(ks), fixed_tps, taken, most,
              per_position(taken, most) if most else 0.0, c, verify)
    say(f"N={n}: plain {row.plain_tps:.1f} tok/s, speculative {row.spec_tps:.1f} ({row.speedup:.2f}x), k used "
        f"{dict(sorted(ks.items()))}, fixed {({k: round(v / row.plain_tps, 2) for k, v in fixed_tps.items()})}")
    return row


def fully_loaded(bench: Bench, report: Report, plain: Any, spec: Any, n: int, pairs: int) -> None:
    """``pairs`` pairs of fully loaded runs, plain then speculative (the same prompts in each pair), into
    ``report``; the verdict said at once (a run cut short still shows it)."""
    met: tuple[dict[str, set[tuple[Any, ...]]], dict[str, set[tuple[Any, ...]]]] = ({}, {})
    runs, ks, cpu = [], Counter[int](), []
    for r in range(pairs):
        p = bench.load(plain, n, seed=40 + r, shapes=met[0])
        cpu_p = bench.cpu_tps
        runs.append((p, bench.load(spec, n, seed=40 + r, shapes=met[1])))
        ks += bench.ks
        cpu.append(bench.cpu_tps / cpu_p)
        say(f"N={n} fully loaded, pair {r + 1}: plain {runs[-1][0]:.1f} tok/s, speculative {runs[-1][1]:.1f} "
            f"({runs[-1][1] / runs[-1][0]:.2f}; tokens per CPU second {cpu[-1]:.2f})")
    report.loaded_pairs[n] = runs
    report.loaded_cpu[n] = statistics.median(cpu)
    report.loaded[n] = (statistics.median(p for p, _ in runs), statistics.median(q for _, q in runs))
    report.fixed_shapes = spec._spec.fixed_shapes
    report.loaded_shapes[n] = {"plain attention": len(met[0].get("attention", ())),
                               **{("speculative " * (kind == "attention")) + kind: len(v)
                                  for kind, v in sorted(met[1].items())}}
    ratio = loaded_ratio(runs)
    say(f"N={n} fully loaded: speculative ÷ plain, median of {len(runs)} pairs {ratio:.2f} (never slower: "
        f">= {NEVER_SLOWER}) {verdict(ratio)}; per CPU second {report.loaded_cpu[n]:.2f}; k used "
        f"{dict(sorted(ks.items()))}; distinct shapes over several positions {report.loaded_shapes[n]}")


def markdown(report: Report) -> str:
    lines = [
        "# Speculative decoding in the batch",
        "",
        f"Generated pair {report.pair.shape} ({report.pair.dtype}, on MLX's {report.pair.device} device): a target "
        f"whose first layer is its one-layer draft's, its other layers' output projections scaled by 0.03; "
        f"greedy, {report.max_tokens} tokens per request; BLAS: {report.blas}. "
        f"The pair's alpha along the target's greedy text: **{report.pair_alpha:.2f}**.",
        "",
        *loaded_lines(report),
    ]
    if report.rows:
        lines += bursts_lines(report)
    if report.ngram_overhead:
        lines += ["", "Prompt lookup (MLXQ_SPECULATE=ngram) on prompts whose text never repeats (random weights: the "
                  "output does not quote the prompt), lookup tok/s ÷ plain tok/s: "
                  + ", ".join(f"N={n}: {v:.2f}" for n, v in report.ngram_overhead.items())]
    if report.copying:
        lines += ["", "Prompt lookup where the answer copies the prompt: small-target with its layers' output "
                  "projections zeroed (each token's successor fixed, the target's cost per step), each prompt a chain "
                  "of successors then its first 32 tokens again, so the answer goes on as the prompt did; lookup ÷ "
                  "plain tok/s (proposals taken): " + ", ".join(f"N={n}: {q / p:.2f}x ({p:.1f} -> {q:.1f} tok/s, "
                                                                f"{t:.2f})" for n, (p, q, t) in report.copying.items())]
    return "\n".join([*lines, ""])


def loaded_lines(report: Report) -> list[str]:
    """The fully loaded runs: each N's paired ratios and their median beside the target, with its verdict."""
    lines = ["Fully loaded (N requests in flight, each that ends replaced, 3N in all; no burst's tail): plain and "
             "speculative runs in pairs, one after the other on the same prompts. The target: speculation never "
             f"slower than plain decoding, the median of the pairs' ratios >= {NEVER_SLOWER}. Per CPU second: the same "
             "ratio of tokens per second of this process's CPU time (steadier than wall time where other work shares "
             "the machine; no target).", "",
             "| N | plain tok/s (median) | speculative tok/s (median) | pairs: speculative ÷ plain | median | target "
             "| verdict | per CPU second (median) |", "|---|---|---|---|---|---|---|---|"]
    for n, runs in report.loaded_pairs.items():
        ratio = loaded_ratio(runs)
        lines.append(f"| {n} | {report.loaded[n][0]:.1f} | {report.loaded[n][1]:.1f} | "
                     f"{', '.join(f'{q / p:.2f}' for p, q in runs)} | {ratio:.2f} | >= {NEVER_SLOWER} | "
                     f"**{verdict(ratio)}** | {report.loaded_cpu.get(n, 0.0):.2f} |")
    return [*lines, "", "Distinct shapes of attention over several positions in the fully loaded runs (on CUDA each "
            "new one builds a cuDNN graph, ~50 ms; shapes kept repeating: " + ("yes" if report.fixed_shapes else "no")
            + "): the speculative batch's passes (verify, draft, draft-prefill: rows held, positions, keys) and "
            "every attention call's (q, k, mask), the target's prefill chunks included, in the plain and "
            "speculative runs: " + "; ".join(f"N={n}: " + ", ".join(f"{kind} {c}" for kind, c in kinds.items())
                                             for n, kinds in report.loaded_shapes.items())]


def bursts_lines(report: Report) -> list[str]:
    """Bursts: each N's plain and speculative tok/s, what the tuner chose, and the bounds for the pair."""
    lines = [
        "",
        "Bursts of N requests. taken: proposals kept / proposed; k: the tuner's most used k (steps per k in "
        "brackets); alpha: the per-position acceptance that gives that rate at that k; c: a draft step's time / a "
        "target step's at that N; v: a target pass over k+1 positions / a target step. ideal: (1 - alpha^(k+1)) / "
        "((1 - alpha)(k*c + 1)), the usual bound, which counts a verification as one target step (true where a step "
        "is memory-bound); ideal here: the same with v in place of that 1, the bound on this machine.",
        "",
        "| N | plain tok/s | speculative tok/s | speedup | taken | k (steps) | alpha | c | v | ideal | of ideal |"
        " ideal here | of it | fixed k: speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        fixed = ", ".join(f"k={k2}: {v / r.plain_tps:.2f}x" for k2, v in sorted(r.fixed.items()))
        used = ", ".join(f"{k2}: {v}" for k2, v in sorted(r.k_used.items()))
        ideal, here = r.ideal(), r.ideal(r.verify)
        lines.append(f"| {r.n} | {r.plain_tps:.1f} | {r.spec_tps:.1f} | {r.speedup:.2f}x | {r.taken:.2f} | {r.k} "
                     f"({used}) | {r.alpha:.2f} | {r.c:.3f} | {r.verify:.2f} | {ideal:.2f}x | {r.speedup / ideal:.2f} "
                     f"| {here:.2f}x | {r.speedup / here:.2f} | {fixed} |")
    return lines


SHAPES = {"auto": None, "repeat": True, "free": False}  # --shapes: Pair.repeat_shapes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.speculative", description=__doc__)
    p.add_argument("--out", default="perf-out")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--fixed", default="2,4", help="k values also run fixed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--pair", default="small", help='"small", or HIDDENxLAYERS (4096x32: an 8 B-class target)')
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "default"],
                   help="MLX's CPU, or its default device (the GPU where there is one)")
    p.add_argument("--shapes", default="auto", choices=["auto", "repeat", "free"],
                   help="the speculative batch's shapes: kept repeating (as on CUDA), free (as elsewhere), or auto")
    p.add_argument("--loaded-pairs", type=int, default=3, help="pairs of fully loaded runs (plain, speculative) per N")
    p.add_argument("--loaded-only", action="store_true",
                   help="only the fully loaded pairs and their verdict (no bursts, fixed k, prompt lookup)")
    args = p.parse_args(argv)
    if args.device == "cpu":  # OpenBLAS serves the CPU's matrix products; a GPU run needs no re-exec
        reexec_with_openblas(["-m", "tests.perf.speculative", *(argv if argv is not None else sys.argv[1:])])
    report = measure([int(x) for x in args.concurrency.split(",")], args.max_tokens,
                     [int(x) for x in args.fixed.split(",") if x], args.repeats,
                     Pair(args.pair, args.dtype, args.device, SHAPES[args.shapes]), args.loaded_pairs, args.loaded_only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.md").write_text(markdown(report))
    (out / "speculative.json").write_text(json.dumps(asdict(report), indent=2))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
