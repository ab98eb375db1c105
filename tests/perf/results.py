"""What the research run measured, put together: one record per model size, and the whole run
(``results.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .models import ModelsResult
from .runs import (
    BenchConfig,
    BlasThreads,
    CancelResult,
    CpuUse,
    EnqueueResult,
    GatewayResult,
    KernelPolicy,
    RoundTrips,
    Row,
    Target,
    TtftProbe,
)
from .scheduling import SchedulingResult
from .tenants import Results as TenantsResult
from .vision import VisionResult

__all__ = ["BenchResult", "SizeResult"]


@dataclass(frozen=True, slots=True)
class SizeResult:
    """Everything measured on one model size."""

    size: str
    model: str
    rows: list[Row]
    ttft_n1: TtftProbe
    cancel: CancelResult
    round_trips: RoundTrips
    cpu: dict[str, CpuUse]  # by path: raw, queue, serial
    worker_blas: str
    seconds: float
    blas_threads: BlasThreads | None = None  # None: no OpenBLAS to tune
    kernel_policy: KernelPolicy | None = None  # None: no kernel thread to set (not Linux, or not the CPU)
    scheduling: SchedulingResult | None = None  # prefix cache, KV over-subscription, priority (scheduling.py)
    gateway: GatewayResult | None = None  # None: the gateway extra is not installed

@dataclass(frozen=True, slots=True)
class BenchResult:
    """The whole run (``results.json``)."""

    machine: dict[str, Any]
    config: BenchConfig
    sizes: list[SizeResult]
    enqueue: EnqueueResult
    targets: list[Target]
    seconds: float
    vision: list[VisionResult]  # image jobs, one per generated qwen2_vl
    models: ModelsResult  # two engines in one worker process
    tenants: TenantsResult | None = None  # issue 37's phase (tests/perf/tenants.py; also tenants.md)

