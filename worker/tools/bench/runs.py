"""The bench's configuration, the records of its runs, and the statistics over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "PROMPT", "SETTLE_S", "TIMEOUT_S", "BenchConfig", "BenchResult", "PathResult", "Row", "Run", "drive", "fmt_list",
    "paired_median", "percentile", "prompt_batch", "safe_ratio", "say",
]

PROMPT = "Hello world number {i} the quick brown fox"  # the first of worker/tools/demo.py's PROMPTS
SETTLE_S = 0.3  # idle pause before every measured run (see paths.frozen)
TIMEOUT_S = 900.0  # one job's wait bound (a large N on a slow model queues for minutes)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one ``mlxq bench`` run measures; ``quick`` is a smoke run of a few seconds."""

    model: str | None = None  # a path or Hugging Face id; None: the generated small model (tiny with quick)
    concurrency: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    repeats: int = 5  # measured runs per path at each N, the paths in turn (the best one counts)
    warmup_tokens: int = 8
    quick: bool = False

    @property
    def capacity(self) -> int:
        """Batch capacity of the queue worker and of the raw path."""
        return max(self.concurrency)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        """Defaults (or the quick ones), overridden by ``--model``, ``--concurrency`` and ``--max-tokens``."""
        base = cls(concurrency=(1, 4), max_tokens=16, repeats=1, warmup_tokens=4, quick=True) if args.quick else cls()
        ns = tuple(int(n) for n in args.concurrency.split(",") if n.strip()) if args.concurrency else base.concurrency
        if not ns or min(ns) < 1:
            raise ValueError("--concurrency needs at least one value; N must be >= 1")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        return dataclasses.replace(base, model=args.model or None, concurrency=tuple(sorted(set(ns))),
                                   max_tokens=args.max_tokens or base.max_tokens)


@dataclass(frozen=True, slots=True)
class Run:
    """One measured run of N requests on one path."""

    tokens: int
    seconds: float
    ttft_ms: list[float]
    rids: list[str] = field(default_factory=list)  # the jobs' ids, in ttft_ms's order (queue and gateway paths)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PathResult:
    """One path at one N: the best run's throughput; TTFT pooled over every measured run."""

    tok_s: float
    runs_tok_s: list[float]
    tokens: int
    seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_samples: int

    @classmethod
    def of(cls, runs: Sequence[Run]) -> PathResult:
        best = max(runs, key=lambda r: r.tok_s)
        ttft = [t for r in runs for t in r.ttft_ms]
        return cls(best.tok_s, [r.tok_s for r in runs], best.tokens, best.seconds,
                   percentile(ttft, 50), percentile(ttft, 99), len(ttft))


def prompt_batch(n: int, offset: int = 0) -> list[str]:
    """``n`` distinct prompts (numbered from ``offset``)."""
    return [PROMPT.format(i=offset + i) for i in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def safe_ratio(a: float, b: float) -> float:
    """``a / b``, 0.0 where ``b`` is not positive."""
    return a / b if b > 0 else 0.0


def paired_median(runs: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over run i of ``runs[i] / baseline[i]`` (runs made seconds apart); 0.0 for no runs."""
    return percentile([safe_ratio(r, b) for r, b in zip(runs, baseline)], 50)


def fmt_list(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


C = TypeVar("C")
R = TypeVar("R")


def drive(prog: str, args: argparse.Namespace, config: Callable[[argparse.Namespace], C],
          measure: Callable[[C, Path], R], write: Callable[[R, Path], str]) -> int:
    """A benchmark command's run: its configuration (a bad one: exit 2), its measurements (a failed run: exit
    1), its outputs written to ``args.out`` and their markdown printed (exit 0); each failure is one line."""
    try:
        cfg = config(args)
    except ValueError as exc:
        say(f"{prog}: {exc}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = measure(cfg, out)
    except RuntimeError as exc:
        say(f"{prog}: failed: {exc}")
        return 1
    print(write(result, out), flush=True)
    return 0


def say(msg: str) -> None:
    """A progress line, to stderr (stdout carries the results)."""
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Row:
    """One N, the paths side by side; ratios are medians over the runs of each run's tok/s / the raw run's
    just before it (runs seconds apart: the machine's slow swings hit both sides alike)."""

    n: int
    raw: PathResult
    queue: PathResult
    gateway: PathResult | None  # None: the gateway extra is not installed
    queue_over_raw: float
    gateway_over_raw: float | None


@dataclass(frozen=True, slots=True)
class BenchResult:
    """The whole run (``results.json``)."""

    model: str
    machine: dict[str, Any]
    config: BenchConfig
    rows: list[Row]
    seconds: float
