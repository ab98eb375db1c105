"""The wire schema's worker health records: what each worker writes of itself and its models to Redis."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ModelState",
    "ModelStatus",
    "WorkerStatus",
]


class ModelState(str, Enum):
    """A model's engine in a worker, as its health record says."""

    LOADING = "loading"
    SERVING = "serving"
    DEAD = "dead"  # its engine failed and could not be rebuilt: its jobs fail with engine_error
    # On demand (MLXQ_LOADABLE_MODELS): not in memory now, loaded when its jobs wait and no live worker has room.
    UNLOADED = "unloaded"
    # On demand, and its load failed (files missing or corrupt): its waiting jobs fail with model_unavailable, and
    # this worker does not try again until it restarts.
    LOAD_FAILED = "load_failed"


class ModelStatus(BaseModel):
    """One model a worker serves, in the worker's health record."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str  # what clients call it (its queue is ``Keys.queue(name)``)
    state: ModelState
    capacity: int = 0  # sequences decoding at once
    running: int = 0  # sequences in the batch now
    waiting: int = 0  # claimed, not yet in the batch
    bulk: int = 0  # its jobs of the bulk band (GenerateRequest.bulk): in its batch (mlxq status: all it holds)
    tokens_per_s: float = 0.0  # tokens generated per second over the last minute
    accepts_images: bool = False
    context_length: int | None = None
    error: str | None = None  # why it is dead (or, load_failed, why it could not load)
    speculation: str = ""  # "draft" or "ngram" when it decodes speculatively, "" when it does not
    drafted: int = 0  # tokens proposed to its sequences since it started
    accepted: int = 0  # of those, tokens the model agreed with
    spec_k: int = 0  # tokens proposed per sequence at its last step (0: it decoded plainly)
    kv_bytes: int = 0  # KV-cache bytes in use (its batch's, and preempted sequences' held)
    kv_headroom_bytes: int = 0  # what its KV caches may fill (0: no KV admission)
    prefix_hits: int = 0  # admissions that reused a cached prompt prefix, since it started
    prefix_misses: int = 0  # admissions that looked for one and found none
    # Prefix affinity (api/affinity.py): its jobs CLAIM placed here because it held their key, here after they
    # waited past MLXQ_AFFINITY_WAIT_MS for the live worker holding it, or here with no live worker holding it;
    # and the keys it advertises now.
    affinity_holder: int = 0
    affinity_elsewhere: int = 0
    affinity_none: int = 0
    affinity_keys: int = 0
    # The prefix cache's tier on disk (all 0 without one): prefixes read from it for a request, requests whose
    # prefix neither memory nor disk held, entries unreadable (their requests prefilled cold), entries written
    # and not written (the writer too far behind), and what it holds now.
    prefix_disk_hits: int = 0
    prefix_disk_misses: int = 0
    prefix_disk_errors: int = 0
    prefix_disk_writes: int = 0
    prefix_disk_dropped: int = 0
    prefix_disk_bytes: int = 0
    prefix_disk_entries: int = 0
    device: str = ""  # where MLX runs it (name, backend, usable memory)
    # On-demand loading (MLXQ_LOADABLE_MODELS): whether it is loaded only when needed (and unloaded when idle, or
    # for another), its weights' bytes (its safetensors files, what MLXQ_MODEL_MEMORY counts), its last load's
    # seconds, and seconds since it last held a job (None: never loaded).
    loadable: bool = False
    weights_bytes: int = 0
    load_s: float | None = None
    idle_s: float | None = None


class WorkerStatus(BaseModel):
    """A worker's health record (``Keys.worker(id)``): written every few seconds, gone soon after it stops."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    host: str
    pid: int
    version: str
    started_at: float  # epoch seconds
    updated_at: float
    draining: bool = False  # shutting down: takes no new jobs
    models: list[ModelStatus] = Field(default_factory=list)
    metrics_url: str | None = None

    def serves(self, model: str) -> bool:
        """Whether this worker takes new jobs of ``model`` now."""
        return not self.draining and any(m.name == model and m.state is ModelState.SERVING for m in self.models)

    def can_load(self, model: str) -> bool:
        """Whether this worker would load ``model`` for its waiting jobs (it has it on demand, not in memory)."""
        return not self.draining and any(m.name == model and m.state in (ModelState.UNLOADED, ModelState.LOADING)
                                         for m in self.models)

