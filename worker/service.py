"""One model a worker serves: its engine on an MLX thread of its own, its claimed jobs and its room for more, and
its part of the health record. What preparing its jobs needs of the loaded model it hands out whole, as a
:class:`~.jobs.model.ModelView` (worker/jobs/prepare.py prepares them).

Nothing here touches Redis; ``worker/host.py`` runs the jobs and decides each one's fate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxq.api.protocol.claim import BelowShare, DueEntry, Outranking
from mlxq.api.schema import PRIORITY_MAX, ModelState, ModelStatus
from mlxq.engine.core.engine import Engine, Sink
from mlxq.engine.core.request import EngineRequest
from mlxq.engine.core.speculation import SpecKind, Speculation
from mlxq.engine.mlx.loader import EngineOptions, LoadedModel, ModelLoadError, start_engine
from mlxq.engine.mlx.quantized_cache import KVQuant
from mlxq.engine.mlx.residency import MemoryReading, ModelThread, memory_now, release

from .config import ServedModel, WorkerConfig
from .jobs.model import ModelView
from .reserve import InteractiveReserve

__all__ = ["ModelService"]

log = logging.getLogger(__name__)


# The health record's fields (ModelStatus) read from the engine's counters (EngineStats): record field, stat.
_RECORD_STATS = (
    ("drafted", "spec_drafted"), ("accepted", "spec_accepted"), ("spec_k", "spec_k"), ("kv_bytes", "kv_bytes"),
    ("kv_headroom_bytes", "kv_headroom_bytes"), ("prefix_hits", "prefix_hits"), ("prefix_misses", "prefix_misses"),
    ("prefix_disk_hits", "prefix_disk_hits"), ("prefix_disk_misses", "prefix_disk_misses"),
    ("prefix_disk_errors", "prefix_disk_errors"), ("prefix_disk_writes", "prefix_disk_writes"),
    ("prefix_disk_dropped", "prefix_disk_dropped"), ("prefix_disk_bytes", "prefix_disk_bytes"),
    ("prefix_disk_entries", "prefix_disk_entries"), ("device", "device"),
)


class ModelService:
    """One served model: load it, count its jobs against its room, run them through its engine."""

    def __init__(self, served: ServedModel, config: WorkerConfig) -> None:
        self.served = served
        self.name = served.name
        self.queue = config.keys.queue(served.name)
        self.bulk_queue = config.keys.queue(served.name, bulk=True)  # its bulk band (api/protocol/lua/bulk.lua)
        self.config = config
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self.active: set[tuple[str, int]] = set()  # its jobs in this worker, claimed and not ended: (id, try)
        self.bulk: set[tuple[str, int]] = set()  # of them, those of the bulk band
        self.reserve = InteractiveReserve(config.bulk_hold_ms / 1000)  # the room its bulk jobs leave (reserve.py)
        self.error: str | None = None  # why its engine died
        self.on_dead: Callable[[ModelService], None] = lambda service: None  # called on the event loop
        # Its jobs' images are prepared one at a time, in arrival order (see worker/jobs/media.py); started with
        # the first image job.
        self._images = ThreadPoolExecutor(1, thread_name_prefix=f"mlxq-images-{served.name}")
        self._view: ModelView | None = None
        # On demand (MLXQ_LOADABLE_MODELS): its thread while loaded, whether a load runs, why its load failed,
        # its last load's seconds, MLX's memory before that load and after its last unload.
        self._thread: ModelThread | None = None
        self.loading = False
        self.load_error: str | None = None
        self.fail_waiting = False  # its load failed and no other live worker may run its jobs: claim them to fail
        self.weights_bytes = 0
        self.load_s: float | None = None
        self.last_used: float | None = None  # time.monotonic() of its last claim or job's end
        self.before_load: MemoryReading | None = None
        self.after_unload: MemoryReading | None = None

    async def load(self, sink: Sink) -> None:
        """Load the model on a new MLX thread of its own and start its engine."""
        cfg = self.config
        share = 1 / max(1, len(cfg.served))  # the machine's memory is split evenly between the models
        opts = EngineOptions(cfg.capacity, cfg.prefill_batch_size, cfg.prefill_step_size,
                             stream_interval_s=cfg.stream_interval_ms / 1000, stream_rate=cfg.stream_rate,
                             kv_headroom_bytes=_bytes(cfg.kv_headroom_gb, share),
                             prefix_cache_bytes=_bytes(cfg.prefix_cache_gb, 1.0), aging_s=cfg.priority_aging_s,
                             bulk_hold_s=cfg.bulk_hold_ms / 1000,
                             memory_share=share, speculation=_speculation(cfg, self.served),
                             kv_disk_bytes=int(cfg.kv_disk_gb * (1 << 30)), kv_dir=cfg.kv_dir, kind=cfg.model_kind,
                             kv_quant=_kv_quant(cfg, self.served))
        thread = ModelThread(name="mlx-" + self.name[-24:]) if self.served.loadable else None
        self.loading, t0 = True, time.perf_counter()
        try:
            if thread is not None:
                self.before_load = await thread.call(memory_now)
            args = (self.served.path, sink, opts)  # (a pinned model's call as ever: tests/perf swaps start_engine)
            self.engine, self.model = await (start_engine(*args) if thread is None
                                             else start_engine(*args, thread=thread))
        except BaseException:
            if thread is not None:
                await thread.close()  # a thread left running aborts the process at exit
            raise
        finally:
            self.loading = False
        self._thread, self.load_s = thread, time.perf_counter() - t0
        self.last_used = time.monotonic()
        self._view = ModelView.of(self.served, cfg, self.model, self._images)
        loop = asyncio.get_running_loop()

        def on_dead() -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(self._died)

        self.engine.on_dead = on_dead

    def _died(self) -> None:
        self.error = "its engine failed and could not be rebuilt"
        log.critical("model %s: %s; its jobs fail with engine_error", self.name, self.error)
        self.on_dead(self)

    async def load_on_demand(self, sink: Sink) -> bool:
        """Load a loadable model for its waiting jobs; False when its files are missing or corrupt (it is marked
        so, :attr:`load_error`, and never tried again by this worker: its jobs fail with model_unavailable)."""
        try:
            await self.load(sink)
        except Exception as exc:  # a broken checkpoint raises more than ModelLoadError: none is tried again
            self.load_error = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            log.error("model %s cannot be loaded: %s; its waiting jobs fail with model_unavailable", self.name,
                      self.load_error, exc_info=not isinstance(exc, ModelLoadError))
            return False
        return True

    async def unload(self) -> MemoryReading:
        """Stop its engine and free its weights on its own MLX thread, then join the thread; what MLX holds
        afterwards. Call only without jobs (its room is 0 from the first line on)."""
        engine, thread = self.engine, self._thread
        assert engine is not None and thread is not None, f"model {self.name} is not loaded on demand"
        self.engine, self.error = None, None  # from here on it takes no job: unloaded (a dead engine too)
        try:
            await engine.aclose()  # stops its steps, hands warm prefixes to the disk tier; the thread stays
        finally:
            held: list[Any] = [engine, self.model, self._view]
            self.model = self._view = self._thread = None
            del engine
            self.after_unload = await thread.call(release, held)
            await thread.close()
        return self.after_unload

    async def aclose(self) -> None:
        """Stop the engine, joining its MLX thread (returns once no MLX call runs)."""
        self._images.shutdown(wait=False)  # what is queued still ends (quickly), as its jobs expect
        if self.engine is not None:
            await self.engine.aclose()
        if self._thread is not None:
            await self._thread.close()

    @property
    def view(self) -> ModelView:
        """What preparing its jobs needs of the loaded model (jobs come only once it is loaded)."""
        assert self._view is not None, f"model {self.name} is not loaded"
        return self._view

    # --- state -------------------------------------------------------------------------------------
    @property
    def state(self) -> ModelState:
        if self.load_error is not None:
            return ModelState.LOAD_FAILED
        if self.engine is None:
            return ModelState.UNLOADED if self.served.loadable and not self.loading else ModelState.LOADING
        return ModelState.DEAD if self.engine.dead else ModelState.SERVING

    def room(self) -> int:
        """How many more jobs it takes now: what its engine can start soon (free slots, within its KV headroom,
        not promised to jobs already claimed), so other workers take what it has no room for."""
        if self.state is ModelState.LOAD_FAILED and self.fail_waiting:  # claimed only to end error(model_unavailable)
            return max(0, self.config.jobs_per_model - len(self.active))
        if self.state is not ModelState.SERVING or self.engine is None:
            return 0
        return max(0, min(self.engine.claim_capacity(), self.config.jobs_per_model - self._unpaused()))

    def bulk_room(self) -> int:
        """How many more bulk jobs it takes now: its room less the slots kept for the interactive jobs it held at
        their recent peak and holds no more (worker/reserve.py)."""
        return max(0, self.room() - self.reserve.reserved(time.monotonic()))

    def outranking(self) -> Outranking | None:
        """What queued jobs need for this model's full engine to take them now (each starts at once, preempting a
        running sequence of lower priority), and how many it takes; None when the engine has room, or no such
        job could start now. Preempted jobs waiting to resume do not count against the model's job cap, nor do bulk
        jobs: they give way to any other (an engine full of them must not keep an interactive job in Redis)."""
        engine = self.engine
        if (self.state is not ModelState.SERVING or engine is None
                or self._unpaused() - len(self.bulk) >= self.config.jobs_per_model):
            return None
        lowest, count = engine.outranked_priority(), engine.outranking_room()
        if lowest is None or lowest >= PRIORITY_MAX or count == 0:
            return None
        return Outranking(lowest + 1, int(self.config.priority_aging_s * 1000), count)

    def below_share(self) -> BelowShare | None:
        """What a queued job's tenant must be for this model's full engine to take it now: below its share of the
        batch, so it starts at once in the place of a running job of a tenant above it (engine/core/shares.py); None
        when the engine has room, or no such job could start now. Each tenant's jobs count its running ones and
        those on their way or waiting unstarted, so a claim takes no more than the share has room for."""
        engine = self.engine
        if self.state is not ModelState.SERVING or engine is None or self._unpaused() >= self.config.jobs_per_model:
            return None
        groups = engine.groups_open()
        if not groups:
            return None
        return BelowShare(max(g.spare for g in groups), {g.group: g.taken for g in groups})

    def _unpaused(self) -> int:
        """Its jobs in this worker less those preempted and waiting to resume."""
        return len(self.active) - (self.engine.paused() if self.engine is not None else 0)

    def status(self, tokens_per_s: float) -> ModelStatus:
        """Its part of the worker's health record."""
        running = self.engine.scheduler.num_running if self.engine is not None else 0
        stats = self.engine.counters() if self.engine is not None else None
        counters = {f: getattr(stats, name) for f, name in _RECORD_STATS} if stats is not None else {}
        model = self.model
        return ModelStatus(name=self.name, state=self.state, capacity=self.config.capacity, running=running,
                           waiting=max(0, len(self.active) - running), tokens_per_s=round(tokens_per_s, 1),
                           bulk=self.engine.scheduler.num_running_bulk if self.engine is not None else 0,
                           accepts_images=model is not None and model.accepts_images,
                           context_length=model.context_length if model is not None else None,
                           error=self.error or self.load_error,
                           speculation=self.config.speculation(self.served), loadable=self.served.loadable,
                           weights_bytes=self.weights_bytes,
                           load_s=None if self.load_s is None else round(self.load_s, 3),
                           idle_s=self.idle_s(), **counters)

    def idle_s(self) -> float | None:
        """Seconds since it last held a job (0 while it holds one; None: never loaded)."""
        if self.active or self.last_used is None:
            return None if self.last_used is None else 0.0
        return round(time.monotonic() - self.last_used, 1)

    # --- jobs ----------------------------------------------------------------------------------------
    def claimed(self, entries: Sequence[DueEntry]) -> None:
        """Jobs just claimed for this model: they count against its room until released, and its idle engine
        waits for all of them (up to ``admit_wait_ms``) before its first step."""
        self.active.update((entry.rid, entry.attempt) for entry in entries)
        if entries:
            self.last_used = time.monotonic()
        self.bulk.update((e.rid, e.attempt) for e in entries if e.bulk)
        self.reserve.note(len(self.active) - len(self.bulk), time.monotonic())
        if entries and self.engine is not None:
            tenants = [entry.tenant for entry in entries]  # their requests' groups
            interactive = sum(1 for entry in entries if not entry.bulk)  # beside bulk rows, no step starts first
            self.engine.expect(len(entries), self.config.admit_wait_ms / 1000, tenants, interactive)

    def release(self, entry: DueEntry) -> None:
        """A claimed job left this worker (ended, handed back, fenced, or failed)."""
        self.active.discard((entry.rid, entry.attempt))
        self.last_used = time.monotonic()
        self.bulk.discard((entry.rid, entry.attempt))
        self.reserve.note(len(self.active) - len(self.bulk), self.last_used)

    def add(self, request: EngineRequest) -> None:
        """A prepared job's request enters the engine (its run is in the run table first)."""
        assert self.engine is not None
        if request.images is not None:  # they took a few ms to prepare: an idle engine waits on for the rest of
            self.engine.expect(0, self.config.admit_wait_ms / 1000)  # their claimed burst
        self.engine.add(request)

    def abort(self, rid: str) -> None:
        """Drop a job between steps (thread-safe; unknown ids are ignored)."""
        if self.engine is not None:
            self.engine.abort(rid)


def _speculation(cfg: WorkerConfig, served: ServedModel) -> Speculation | None:
    mode = cfg.speculation(served)
    if not mode:
        return None
    return Speculation(SpecKind(mode), served.draft or None, cfg.speculate_k)


def _kv_quant(cfg: WorkerConfig, served: ServedModel) -> KVQuant | None:
    quant = cfg.kv_quant(served)
    return None if quant is None else KVQuant(*quant)


def _bytes(gigabytes: float | None, share: float) -> int | None:
    return None if gigabytes is None else int(gigabytes * share * (1 << 30))
