"""The research run's configuration and the records of its measurements (a run, a path's result and the statistics
over them are the product bench's: ``mlxq.worker.tools.bench.runs``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlxq.worker.tools.bench.runs import PathResult, percentile

NOBODY = "mlxq-bench-nobody"  # model name of the enqueue phase: no worker serves its queue
PROBE_TOKENS = 2  # max_tokens of the N=1 TTFT probe requests
PROBE_OFFSET = 1000  # prompt numbers of probe requests
BLAS_MARGIN = 0.05  # more OpenBLAS threads only when their raw median is this much faster (see suite.pick_threads)


# --- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one bench run measures; ``quick`` is a smoke run of a few seconds."""

    sizes: tuple[str, ...] = ("tiny", "small")
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    max_tokens: int = 64
    repeats: int = 7  # measured runs per N on raw and queue, in pairs (the machine is noisy: ±20 % run to run)
    tiny_repeats: int = 15  # the tiny model's runs take under a second: more pairs cost little, steady the medians
    serial_repeats: int = 1  # serial runs are N jobs back to back: already an average
    blas_repeats: int = 3  # raw runs per OpenBLAS thread count when choosing it
    policy_repeats: int = 5  # raw run pairs per N measuring MLX's kernel thread policy (engine/mlx/thread.py)
    warmup_tokens: int = 8
    ttft_probes: int = 20  # sequential N=1 requests per path for the TTFT targets
    cancel_max_tokens: int = 400  # fits the tiny model's 512-token context with the prompt
    cancel_wait: tuple[int, int] = (2, 40)  # token events to wait before a cancel, drawn uniformly
    enqueue_jobs: int = 2000
    enqueue_batch: int = 64
    vision_concurrency: tuple[int, ...] = (1, 8)  # image jobs at once (the generated qwen2_vl models, vision.py)
    vision_repeats: int = 7  # measured raw/queue pairs per N of image jobs
    models_n: int = 8  # jobs per model in the two-models phase (models.py)
    models_repeats: int = 9  # sequential/concurrent pairs there (tiny models: each pair takes under a second)
    scheduling_probes: int = 5  # TTFT probes per side of the prefix-cache and priority measurements
    scheduling_repeats: int = 2  # measured rounds of the over-subscription runs (limited and unlimited)
    quick: bool = False

    def repeats_for(self, size: str) -> int:
        """Measured raw/queue pairs per N for a model size."""
        return self.tiny_repeats if size == "tiny" else self.repeats

    def vision_repeats_for(self, name: str) -> int:
        """Measured raw/queue pairs per N of image jobs on a generated qwen2_vl (``tiny-vl``, ``small-vl``): the
        tiny one's runs take a fraction of a second, as the tiny text model's, and get as many pairs."""
        return self.tiny_repeats if name.startswith("tiny") else self.vision_repeats

    @property
    def capacity(self) -> int:
        """Batch capacity of the queue worker (and jobs of the cancel phase)."""
        return max(self.concurrency)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        """Defaults (or the quick ones), overridden by ``--sizes``, ``--concurrency``, ``--max-tokens``."""
        base = cls.quick_config() if args.quick else cls()
        sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip()) if args.sizes else base.sizes
        ns = (tuple(int(n) for n in args.concurrency.split(",") if n.strip()) if args.concurrency
              else base.concurrency)
        if not sizes or not ns or min(ns) < 1:
            raise ValueError("--sizes and --concurrency need at least one value; N must be >= 1")
        return dataclasses.replace(base, sizes=sizes, concurrency=tuple(sorted(set(ns))),
                                   max_tokens=args.max_tokens or base.max_tokens)

    @classmethod
    def quick_config(cls) -> BenchConfig:
        return cls(sizes=("tiny",), concurrency=(1, 4), max_tokens=16, repeats=1, tiny_repeats=1, blas_repeats=1,
                   policy_repeats=1,
                   warmup_tokens=4, ttft_probes=5, cancel_max_tokens=128, cancel_wait=(2, 8), enqueue_jobs=200,
                   vision_concurrency=(1, 2), vision_repeats=1, models_n=2, models_repeats=1,
                   scheduling_probes=2, scheduling_repeats=1, quick=True)


# --- records ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Row:
    """One model size at one N, the three paths side by side."""

    size: str
    n: int
    raw: PathResult
    queue: PathResult
    serial: PathResult
    queue_over_raw: float  # best queue run / best raw run
    queue_over_serial: float
    added_ttft_p50_ms: float  # queue - raw
    added_ttft_p99_ms: float
    queue_over_raw_paired: float = 0.0  # median over run pairs (raw run i, then queue run i) of their ratio
    engine: PathResult | None = None  # the worker's engine in-process, no Redis (see _EngineRun)
    engine_over_raw_paired: float = 0.0  # median over the runs of engine run i / raw run i
    queue_over_engine_paired: float = 0.0  # median over the runs of queue run i / engine run i
    server: PathResult | None = None  # mlx_lm.server on the same model and prompts (peer.py)
    queue_over_server_paired: float = 0.0  # median over the runs of queue run i / server run i


@dataclass(frozen=True, slots=True)
class TtftProbe:
    """TTFT of sequential single requests (``PROBE_TOKENS`` each): the N=1 TTFT targets."""

    samples: int
    raw_p50_ms: float
    raw_p99_ms: float
    queue_p50_ms: float
    queue_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float


@dataclass(frozen=True, slots=True)
class CancelResult:
    """Cancel -> terminal event, measured by the client, with the decode step time seen meanwhile."""

    jobs: int
    cancelled: int  # jobs that ended ``done(cancelled)``; the others finished first and are not timed
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    step_ms_mean: float | None
    budget_ms: float | None  # one decode step + 50 ms


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """The worker's counters (scraped from its metrics endpoint): event-publishing round trips per engine step."""

    engine_steps: int
    redis_writes: int
    events: int
    other: dict[str, int] = field(default_factory=dict)  # its other counters, by metric name

    @property
    def writes_per_step(self) -> float:
        return self.redis_writes / self.engine_steps if self.engine_steps else 0.0


@dataclass(frozen=True, slots=True)
class RoundTrips:
    """Round trips of one model size: both workers' counters, and Redis commandstats of the queue runs."""

    queue_worker: WorkerStats
    queue_writes_per_step: float
    serial_worker: WorkerStats
    serial_writes_per_step: float
    commandstats: dict[str, int]  # calls during the queue path's throughput runs (every client included)


@dataclass(frozen=True, slots=True)
class CpuUse:
    """CPU seconds each process used during one path's throughput runs (N cores give N s per wall second).

    ``bench`` is this process: the model itself on the raw path, the client on the queue and serial paths.
    """

    wall_s: float
    bench_s: float
    worker_s: float
    redis_s: float


@dataclass(frozen=True, slots=True)
class BlasThreads:
    """OpenBLAS threads for one model size: the count whose raw runs were clearly faster, used by every path.

    The ceiling must be raw's best configuration. A small model's gemms are too small to split: the second
    thread then only spins (a whole core) between calls, and raw runs faster with one.
    """

    chosen: int
    raw_tok_s: dict[int, list[float]]  # threads -> raw runs at the largest N, alternating


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    """Raw runs with the MLX stream's kernel thread under SCHED_BATCH (as every mlxq MLX thread runs it,
    engine/mlx/thread.py) and under the default policy, in turn, at N=1 and the largest N."""

    raw_tok_s: dict[str, dict[int, list[float]]]  # "batch" / "default" -> N -> runs
    batch_over_default_paired: dict[int, float]


@dataclass(frozen=True, slots=True)
class GatewayRow:
    """One N on the same queue worker: the in-process client and the HTTP gateway, streaming, run by run in turn."""

    n: int
    queue: PathResult
    gateway: PathResult
    gateway_over_queue: float  # best gateway run / best queue run
    gateway_over_queue_paired: float  # median over the run pairs of gateway run i / queue run i
    added_ttft_p50_ms: float  # gateway - queue
    added_ttft_p99_ms: float


@dataclass(frozen=True, slots=True)
class GatewayProbe:
    """TTFT of sequential single requests (``PROBE_TOKENS`` each), queue and gateway in turn."""

    samples: int
    queue_p50_ms: float
    queue_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float


@dataclass(frozen=True, slots=True)
class GatewayResult:
    """The gateway path of one model size: rows per N, the N=1 probe, and CPU per path (``gateway_s``: the
    gateway process's CPU seconds over the gateway runs)."""

    rows: list[GatewayRow]
    probe: GatewayProbe
    cpu_queue: CpuUse
    cpu_gateway: CpuUse
    gateway_s: float


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """Jobs/s of one producer into a queue no worker serves."""

    jobs: int
    sequential_jobs_s: float
    gathered_jobs_s: float
    gather_batch: int


@dataclass(frozen=True, slots=True)
class Target:
    """One target of issue #3 and whether this run met it."""

    name: str
    value: float
    limit: str
    passed: bool


@dataclass(frozen=True, slots=True)
class Site:
    """Where the bench runs: the embedded Redis and the output directory."""

    url: str
    redis_pid: int
    out: Path


# --- small helpers ---------------------------------------------------------------------------------
def pct_or_none(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_runs(p: PathResult) -> str:
    return ", ".join(f"{v:.1f}" for v in p.runs_tok_s)
