"""Worker configuration, read once from the environment (prefix ``MLXQ_``) and passed down as one object."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from mlxq.api.config import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_REDIS_URL,
    EnvReader,
)
from mlxq.api.errors import ConfigError
from mlxq.api.keys import DONE_TTL_S, LIVE_TTL_S, Keys
from mlxq.api.schema import job_bytes_limit

__all__ = ["LOG_LEVELS", "ServedModel", "WorkerConfig"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SPECULATE = ("", "draft", "ngram")  # MLXQ_SPECULATE: off, a draft model proposes, the row's own text proposes


def _worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a worker serves: where it loads from, and the name clients give (which names its queue)."""

    path: str
    name: str
    draft: str = ""  # the draft model that proposes its tokens (speculative decoding); "": none


def parse_models(spec: str) -> tuple[ServedModel, ...]:
    """``MLXQ_MODELS``: ``path[=alias][+draft_path],...``; a model without an alias is called by its path."""
    served = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        item, _, draft = item.partition("+")
        path, _, alias = item.partition("=")
        served.append(ServedModel(path.strip(), alias.strip() or path.strip(), draft.strip()))
    return tuple(served)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs to know; see README for each variable."""

    model: str = ""  # MLXQ_MODEL: local path, or a hub id on a Mac
    model_name: str = ""  # MLXQ_MODEL_NAME: alias clients use instead of MLXQ_MODEL
    models: str = ""  # MLXQ_MODELS: several models, "path[=alias][+draft_path],..." (instead of MLXQ_MODEL)
    draft_model: str = ""  # MLXQ_DRAFT_MODEL: a draft model for MLXQ_MODEL (speculative decoding)
    speculate: str = ""  # MLXQ_SPECULATE: "draft", "ngram" (prompt lookup) or "" (off; "draft" with a draft model)
    speculate_k: int = 4  # MLXQ_SPECULATE_K: the most tokens proposed per sequence and step
    redis_url: str = DEFAULT_REDIS_URL  # MLXQ_REDIS_URL
    prefix: str = "mlxq"  # MLXQ_PREFIX
    capacity: int = 32  # MLXQ_BATCH_CAPACITY: sequences decoding at once
    prefill_batch_size: int = 8  # MLXQ_PREFILL_BATCH
    prefill_step_size: int = 512  # MLXQ_PREFILL_STEP
    admit_wait_ms: float = 10.0  # MLXQ_ADMIT_WAIT_MS: longest an idle engine waits for jobs claimed together
    stream_interval_ms: float = 20.0  # MLXQ_STREAM_INTERVAL_MS: longest a token waits to be sent (0: every step)
    stream_rate: float = 1600.0  # MLXQ_STREAM_RATE: most token events a second per model (0: no bound)
    max_jobs: int = 0  # MLXQ_MAX_JOBS: arq jobs held at once (0: arq_max_jobs)
    poll_delay_s: float = 0.25  # MLXQ_POLL_DELAY: arq's queue poll period when no wake-up comes
    job_timeout_s: float = 600.0  # MLXQ_JOB_TIMEOUT: a job's deadline inside the engine
    max_tokens_limit: int = 8192  # MLXQ_MAX_TOKENS: largest max_tokens accepted
    max_prompt_tokens: int = 32768  # MLXQ_MAX_PROMPT_TOKENS
    # MLXQ_MAX_PAYLOAD_BYTES: a job's JSON, checked before decoding it (the defaults of the job limits are the
    # producer's, api/config.py, so both sides check the same)
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_stop_strings: int = 16  # MLXQ_MAX_STOP_STRINGS
    max_stop_chars: int = 256  # MLXQ_MAX_STOP_CHARS: length of one stop string
    max_tries: int = 3  # MLXQ_MAX_TRIES: runs of one job (after worker loss or shutdown)
    cancel_poll_s: float = 0.25  # MLXQ_CANCEL_POLL: backstop poll of cancel keys (pub/sub is the fast path)
    drain_timeout_s: float = 30.0  # MLXQ_DRAIN_TIMEOUT: on SIGTERM, how long running jobs may finish
    # MLXQ_SHUTDOWN_GRACE: past the drain, a hung shutdown dumps stacks and exits 1 (drain + grace stays inside
    # the 45 s stop timeouts of deploy/)
    shutdown_grace_s: float = 10.0
    lease_ttl_s: float = 10.0  # MLXQ_LEASE_TTL: a running job's lease; the reaper re-runs jobs without one
    reap_interval_s: float = 2.0  # MLXQ_REAP_INTERVAL: how often each worker looks for lost jobs
    live_ttl_s: int = LIVE_TTL_S  # MLXQ_LIVE_TTL: replay log TTL while a job runs (refreshed on every write)
    done_ttl_s: int = DONE_TTL_S  # MLXQ_DONE_TTL: replay log TTL after the terminal event
    keep_result_s: int = 60  # MLXQ_KEEP_RESULT: arq's result key TTL
    heartbeat_s: float = 2.0  # MLXQ_HEARTBEAT: how often the worker's health record is written
    # MLXQ_KV_HEADROOM_GB: KV-cache bytes the batches may hold, split evenly between the models; unset: 75 % of
    # the memory MLX may use less the weights and the prefix cache (engine/memory.py)
    kv_headroom_gb: float | None = None
    # MLXQ_PREFIX_CACHE_GB: bytes of cached prompt prefixes, per model; unset: a tenth of memory (at most 4 GiB);
    # 0: off
    prefix_cache_gb: float | None = None
    priority_aging_s: float = 1.0  # MLXQ_PRIORITY_AGING: waiting one priority level is worth (as producers')
    # MLXQ_MLX_MEMORY_GB, MLXQ_MLX_CACHE_GB: MLX's process-wide memory limit and the freed buffers it keeps for
    # reuse (engine/mlx_process.py; one value for the whole process, whatever the models); unset: MLX's default
    mlx_memory_gb: float | None = None
    mlx_cache_gb: float | None = None
    metrics_port: int = 0  # MLXQ_METRICS_PORT: serve Prometheus metrics on this port (0: off)
    metrics_addr: str = "0.0.0.0"  # MLXQ_METRICS_ADDR: the address it listens on
    max_images: int = DEFAULT_MAX_IMAGES  # MLXQ_MAX_IMAGES: images in one job
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # MLXQ_MAX_IMAGE_BYTES: one image file (decoded, or fetched)
    max_image_pixels: int = 4096 * 4096  # MLXQ_MAX_IMAGE_PIXELS: width x height of one image, read before decoding
    image_urls: bool = False  # MLXQ_IMAGE_URLS: fetch http(s) image URLs (else data: URLs only)
    image_fetch_timeout_s: float = 10.0  # MLXQ_IMAGE_FETCH_TIMEOUT: one http(s) image's whole fetch
    # MLXQ_IMAGE_URL_PRIVATE: fetch image URLs from loopback, private and link-local addresses too (else only
    # public ones: a job must not reach the worker's own network)
    image_url_private: bool = False
    # MLXQ_CONNECT_DEADLINE: a starting worker waits this long for Redis to answer, then exits 69 with one line
    # (a supervisor restarts it); once started, redis-py's retries ride out a restart of Redis
    connect_deadline_s: float = 30.0
    log_level: str = "INFO"  # MLXQ_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR; DEBUG adds start-up failures' tracebacks
    worker_id: str = field(default_factory=_worker_id)

    @property
    def mlx_limits(self) -> tuple[int | None, int | None]:
        """MLX's process-wide memory and cache limits in bytes (None: MLX's default)."""
        def gib(v: float | None) -> int | None:
            return None if v is None else int(v * (1 << 30))

        return gib(self.mlx_memory_gb), gib(self.mlx_cache_gb)

    @property
    def served(self) -> tuple[ServedModel, ...]:
        """The models this worker serves: ``MLXQ_MODELS``, else ``MLXQ_MODEL`` (called ``MLXQ_MODEL_NAME``)."""
        if self.models:
            return parse_models(self.models)
        return (ServedModel(self.model, self.model_name or self.model, self.draft_model),) if self.model else ()

    def speculation(self, served: ServedModel) -> str:
        """How ``served`` speculates: "draft" (with its draft model), "ngram", or "" (it does not)."""
        if served.draft:
            return "draft"
        return "ngram" if self.speculate == "ngram" else ""

    @property
    def arq_job_timeout_s(self) -> float:
        """arq's own job timeout: behind the engine's deadline, so the engine's fires first."""
        return self.job_timeout_s + 30.0

    @property
    def max_job_bytes(self) -> int:
        """The largest job (JSON) read: the payload limit plus room for ``max_images`` of the largest image."""
        return job_bytes_limit(self.max_payload_bytes, self.max_images, self.max_image_bytes)

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    @property
    def jobs_per_model(self) -> int:
        """Jobs one model's engine holds at most: its batch, and a few waiting so a freed slot refills at once."""
        return self.capacity + max(2, self.capacity // 4)

    @property
    def arq_max_jobs(self) -> int:
        """arq's slots: each model's jobs, and as many again as its batch for jobs preempted and paused (which
        hold a slot while they wait to resume, and must not keep a job of higher priority in Redis)."""
        return self.max_jobs or (self.jobs_per_model + self.capacity) * max(1, len(self.served))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerConfig:
        """Read ``MLXQ_*`` variables; unset ones keep their defaults. A value that does not parse, or is out of
        range, raises :class:`api.errors.ConfigError` naming the variable."""
        e = EnvReader(os.environ if env is None else env)
        d = cls()
        return cls(
            model=e.text("MLXQ_MODEL", d.model),
            model_name=e.text("MLXQ_MODEL_NAME", d.model_name),
            models=e.text("MLXQ_MODELS", d.models),
            draft_model=e.text("MLXQ_DRAFT_MODEL", d.draft_model),
            speculate=_speculate(e.text("MLXQ_SPECULATE", d.speculate)),
            speculate_k=e.integer("MLXQ_SPECULATE_K", d.speculate_k, minimum=1),
            redis_url=e.text("MLXQ_REDIS_URL", d.redis_url),
            prefix=e.text("MLXQ_PREFIX", d.prefix),
            capacity=e.integer("MLXQ_BATCH_CAPACITY", d.capacity, minimum=1),
            prefill_batch_size=e.integer("MLXQ_PREFILL_BATCH", d.prefill_batch_size, minimum=1),
            prefill_step_size=e.integer("MLXQ_PREFILL_STEP", d.prefill_step_size, minimum=1),
            admit_wait_ms=e.number("MLXQ_ADMIT_WAIT_MS", d.admit_wait_ms, minimum=0),
            stream_interval_ms=e.number("MLXQ_STREAM_INTERVAL_MS", d.stream_interval_ms, minimum=0),
            stream_rate=e.number("MLXQ_STREAM_RATE", d.stream_rate, minimum=0),
            max_jobs=e.integer("MLXQ_MAX_JOBS", d.max_jobs, minimum=0),
            poll_delay_s=e.number("MLXQ_POLL_DELAY", d.poll_delay_s, minimum=0.001),
            job_timeout_s=e.number("MLXQ_JOB_TIMEOUT", d.job_timeout_s, minimum=0.001),
            max_tokens_limit=e.integer("MLXQ_MAX_TOKENS", d.max_tokens_limit, minimum=1),
            max_prompt_tokens=e.integer("MLXQ_MAX_PROMPT_TOKENS", d.max_prompt_tokens, minimum=1),
            max_payload_bytes=e.integer("MLXQ_MAX_PAYLOAD_BYTES", d.max_payload_bytes, minimum=1),
            max_stop_strings=e.integer("MLXQ_MAX_STOP_STRINGS", d.max_stop_strings, minimum=0),
            max_stop_chars=e.integer("MLXQ_MAX_STOP_CHARS", d.max_stop_chars, minimum=1),
            max_tries=e.integer("MLXQ_MAX_TRIES", d.max_tries, minimum=1),
            cancel_poll_s=e.number("MLXQ_CANCEL_POLL", d.cancel_poll_s, minimum=0.001),
            drain_timeout_s=e.number("MLXQ_DRAIN_TIMEOUT", d.drain_timeout_s, minimum=0),
            shutdown_grace_s=e.number("MLXQ_SHUTDOWN_GRACE", d.shutdown_grace_s, minimum=0),
            lease_ttl_s=e.number("MLXQ_LEASE_TTL", d.lease_ttl_s, minimum=0.1),
            reap_interval_s=e.number("MLXQ_REAP_INTERVAL", d.reap_interval_s, minimum=0.01),
            live_ttl_s=e.integer("MLXQ_LIVE_TTL", d.live_ttl_s, minimum=1),
            done_ttl_s=e.integer("MLXQ_DONE_TTL", d.done_ttl_s, minimum=1),
            keep_result_s=e.integer("MLXQ_KEEP_RESULT", d.keep_result_s, minimum=0),
            heartbeat_s=e.number("MLXQ_HEARTBEAT", d.heartbeat_s, minimum=0.05),
            kv_headroom_gb=e.optional_number("MLXQ_KV_HEADROOM_GB", minimum=0.001),
            prefix_cache_gb=e.optional_number("MLXQ_PREFIX_CACHE_GB", minimum=0),
            priority_aging_s=e.number("MLXQ_PRIORITY_AGING", d.priority_aging_s, minimum=0),
            mlx_memory_gb=e.optional_number("MLXQ_MLX_MEMORY_GB", minimum=0.001),
            mlx_cache_gb=e.optional_number("MLXQ_MLX_CACHE_GB", minimum=0),
            metrics_port=e.integer("MLXQ_METRICS_PORT", d.metrics_port, minimum=0),
            metrics_addr=e.text("MLXQ_METRICS_ADDR", d.metrics_addr),
            max_images=e.integer("MLXQ_MAX_IMAGES", d.max_images, minimum=0),
            max_image_bytes=e.integer("MLXQ_MAX_IMAGE_BYTES", d.max_image_bytes, minimum=1),
            max_image_pixels=e.integer("MLXQ_MAX_IMAGE_PIXELS", d.max_image_pixels, minimum=1),
            image_urls=e.flag("MLXQ_IMAGE_URLS", d.image_urls),
            image_fetch_timeout_s=e.number("MLXQ_IMAGE_FETCH_TIMEOUT", d.image_fetch_timeout_s, minimum=0.001),
            image_url_private=e.flag("MLXQ_IMAGE_URL_PRIVATE", d.image_url_private),
            connect_deadline_s=e.number("MLXQ_CONNECT_DEADLINE", d.connect_deadline_s, minimum=0),
            log_level=_log_level(e.text("MLXQ_LOG_LEVEL", d.log_level)),
        )


def _speculate(raw: str) -> str:
    mode = raw.strip().lower()
    if mode in ("off", "0", "none"):
        return ""
    if mode not in SPECULATE:
        raise ConfigError(f"MLXQ_SPECULATE={raw!r}: expected draft, ngram or off")
    return mode


def _log_level(raw: str) -> str:
    level = raw.strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ConfigError(f"MLXQ_LOG_LEVEL={raw!r}: expected one of {', '.join(LOG_LEVELS)}")
    return level

