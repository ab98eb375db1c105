"""Worker configuration, read once from the environment (prefix ``MLXQ_``) and passed down as one object; each
variable is declared once, on its field (``api/settings.py``).

``python3 -m mlxq.worker.config`` prints every mlxq setting (producers', gateway's, workers', tools') as the
Markdown table of ``deploy/README.md``'s "Settings" section.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

from mlxq.api.config import ClientConfig, ToolConfig
from mlxq.api.errors import ConfigError
from mlxq.api.gateway.config import GatewayConfig
from mlxq.api.protocol.keys import DONE_TTL_S, KEEP_RESULT_S, LIVE_TTL_S, Keys
from mlxq.api.schema import job_bytes_limit
from mlxq.api.settings import markdown, read, setting, shared

__all__ = ["LOG_LEVELS", "SETTING_GROUPS", "PerModel", "ServedModel", "WorkerConfig", "reference"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SPECULATE = ("", "draft", "ngram")  # MLXQ_SPECULATE: off, a draft model proposes, the row's own text proposes
MODEL_KINDS = ("auto", "chat", "embedding")  # MLXQ_MODEL_KIND
KV_BITS = ("8", "4")  # MLXQ_KV_BITS besides off
KV_GROUP_SIZES = ("32", "64", "128")  # what mx.quantize takes


def _worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a worker serves: where it loads from, and the name clients give (which names its queue)."""

    path: str
    name: str
    draft: str = ""  # the draft model that proposes its tokens (speculative decoding); "": none
    loadable: bool = False  # loaded only while its jobs need it (MLXQ_LOADABLE_MODELS); else pinned, loaded at start


@dataclass(frozen=True, slots=True)
class PerModel:
    """A setting's value for every model, and for some by name (``MLXQ_KV_BITS=8,small=off``: small's is 0, every
    other model's 8)."""

    default: int
    named: tuple[tuple[str, int], ...] = ()  # (model name, its value)

    def of(self, name: str) -> int:
        """The value for the model called ``name``."""
        return dict(self.named).get(name, self.default)


KV_OFF, KV_GROUP_64 = PerModel(0), PerModel(64)  # MLXQ_KV_BITS's and MLXQ_KV_GROUP_SIZE's defaults


def parse_models(spec: str, *, loadable: bool = False) -> tuple[ServedModel, ...]:
    """``MLXQ_MODELS`` (or ``MLXQ_LOADABLE_MODELS``): ``path[=alias][+draft_path],...``; a model without an alias
    is called by its path."""
    served = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        item, _, draft = item.partition("+")
        path, _, alias = item.partition("=")
        served.append(ServedModel(path.strip(), alias.strip() or path.strip(), draft.strip(), loadable))
    return tuple(served)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs to know: each variable declared on its field (deploy/README.md, "Settings")."""

    model: str = setting("MLXQ_MODEL", "", "the model to serve: a local path, or a Hugging Face id (mlx-lm "
                         "downloads it on a Mac); required unless MLXQ_MODELS is set")
    model_name: str = setting("MLXQ_MODEL_NAME", "", "the name clients give MLXQ_MODEL (names its queue); unset: "
                              "MLXQ_MODEL itself")
    models: str = setting("MLXQ_MODELS", "", "several models in one process, path[=alias][+draft_path],... "
                          "(instead of MLXQ_MODEL)")
    loadable_models: str = setting("MLXQ_LOADABLE_MODELS", "", "models loaded on demand, path[=alias][+draft_path],"
                                   "...: each loads when its jobs wait and no live worker has room for them, and "
                                   "unloads when idle or for another (MLXQ_MODEL, MLXQ_MODELS: loaded at start, "
                                   "pinned)")
    model_memory: int | None = setting("MLXQ_MODEL_MEMORY", None, "the most weight bytes loaded at once (e.g. "
                                       "24GiB; each model counts its .safetensors files, pinned ones too): the "
                                       "least recently used idle loadable model unloads to make room",
                                       parse=lambda name, raw: parse_size(name, raw), shown="no bound")
    model_idle_s: float = setting("MLXQ_MODEL_IDLE_S", 300.0, "seconds a loadable model stays loaded without a "
                                  "job, then unloads; 0: only to make room", minimum=0)
    draft_model: str = setting("MLXQ_DRAFT_MODEL", "", "a draft model for MLXQ_MODEL (speculative decoding; same "
                               "vocabulary; with MLXQ_MODELS, name each model's draft there)")
    speculate: str = setting("MLXQ_SPECULATE", "", "ngram: prompt lookup for every model without a draft; draft: "
                             "require one for each model; off", parse=lambda name, raw: _speculate(raw),
                             shown="off (draft with a draft model)")
    model_kind: str = setting("MLXQ_MODEL_KIND", "auto", "what the served models are: auto (an embedding model by "
                              "its sentence-transformers files with last-token pooling, else a chat model), chat, or "
                              "embedding (a decoder whose last token's state is the vector)",
                              parse=lambda name, raw: _model_kind(raw))
    speculate_k: int = setting("MLXQ_SPECULATE_K", 4, "the most tokens proposed per sequence and step", minimum=1)
    redis_url: str = shared(ClientConfig, "redis_url")
    prefix: str = shared(ClientConfig, "prefix")
    capacity: int = setting("MLXQ_BATCH_CAPACITY", 32, "sequences decoding at once, per model", minimum=1)
    prefill_batch_size: int = setting("MLXQ_PREFILL_BATCH", 8, "prompts prefilled together", minimum=1)
    prefill_step_size: int = setting("MLXQ_PREFILL_STEP", 512, "tokens per prefill chunk", minimum=1)
    admit_wait_ms: float = setting("MLXQ_ADMIT_WAIT_MS", 10.0, "an idle engine waits at most this long for the jobs "
                                   "claimed with its first one, and for more while they keep coming less than a "
                                   "fifth of it apart (a burst prefills as one batch)", minimum=0)
    stream_interval_ms: float = setting("MLXQ_STREAM_INTERVAL_MS", 20.0, "longest a generated token waits to be sent "
                                        "(tokens in between go in one event); 0: every step (within "
                                        "MLXQ_STREAM_RATE)", minimum=0)
    stream_rate: float = setting("MLXQ_STREAM_RATE", 1600.0, "most token events a second per model: with more "
                                 "streams than 32, each waits longer (64: 40 ms); 0: no bound", minimum=0)
    bulk_hold_ms: float = setting("MLXQ_BULK_HOLD_MS", 5000.0, "a model's bulk jobs leave free the slots its "
                                  "interactive jobs held at their peak within this window (their next ones, after a "
                                  "pause of a client's, need no preemption), and its engine admits bulk jobs one a "
                                  "step for up to a second of it after its last interactive one; 0: bulk takes any "
                                  "free slot",
                                  minimum=0)
    max_jobs: int = setting("MLXQ_MAX_JOBS", 0, "arq jobs held at once: the batch, a few waiting inside the engine, "
                            "and room for as many preempted ones waiting to resume", minimum=0,
                            shown="0: 2 x capacity + max(2, capacity/4) per model")
    poll_delay_s: float = setting("MLXQ_POLL_DELAY", 0.25, "seconds: arq's fallback poll period; producers' wake-ups "
                                  "(and freed slots) wake it at once", minimum=0.001)
    job_timeout_s: float = setting("MLXQ_JOB_TIMEOUT", 600.0, "seconds: a job's deadline in the engine → "
                                   "error(timeout)", minimum=0.001)
    max_tokens_limit: int = setting("MLXQ_MAX_TOKENS", 8192, "largest max_tokens a job may ask for → "
                                    "error(bad_request)", minimum=1)
    max_prompt_tokens: int = setting("MLXQ_MAX_PROMPT_TOKENS", 32768, "longest prompt, in tokens → "
                                     "error(bad_request)", minimum=1)
    max_payload_bytes: int = shared(ClientConfig, "max_payload_bytes")
    max_stop_strings: int = setting("MLXQ_MAX_STOP_STRINGS", 16, "stop strings in one job", minimum=0)
    max_stop_chars: int = setting("MLXQ_MAX_STOP_CHARS", 256, "length of one stop string", minimum=1)
    max_tries: int = setting("MLXQ_MAX_TRIES", 3, "runs of a job that may start (after a lost worker or a "
                             "shutdown), then error(worker_lost)", minimum=1)
    cancel_poll_s: float = setting("MLXQ_CANCEL_POLL", 0.25, "seconds: backstop poll of cancel keys (pub/sub is the "
                                   "fast path)", minimum=0.001)
    drain_timeout_s: float = setting("MLXQ_DRAIN_TIMEOUT", 30.0, "seconds running jobs may finish after SIGTERM; the "
                                     "rest are re-queued", minimum=0)
    # Drain + grace stays inside the 45 s stop timeouts of deploy/.
    shutdown_grace_s: float = setting("MLXQ_SHUTDOWN_GRACE", 10.0, "seconds: a shutdown still running this long "
                                      "after the drain writes every thread's stack to the log and exits 1", minimum=0)
    lease_ttl_s: float = setting("MLXQ_LEASE_TTL", 10.0, "seconds: a running job's lease (refreshed every TTL/3); a "
                                 "job without one is reaped", minimum=0.1)
    reap_interval_s: float = setting("MLXQ_REAP_INTERVAL", 2.0, "seconds between each worker's looks for jobs whose "
                                     "worker died", minimum=0.01)
    live_ttl_s: int = setting("MLXQ_LIVE_TTL", LIVE_TTL_S, "seconds a job's replay log lives while it runs "
                              "(refreshed on every write)", minimum=1)
    done_ttl_s: int = setting("MLXQ_DONE_TTL", DONE_TTL_S, "seconds a job's replay log lives after it ended",
                              minimum=1)
    keep_result_s: int = setting("MLXQ_KEEP_RESULT", KEEP_RESULT_S, "seconds an ended job's result (its text, "
                                 "reasoning and end: Client.result, `mlxq job`) is kept, unless its request's "
                                 "keep_result_s says; 0: none", minimum=0)
    heartbeat_s: float = setting("MLXQ_HEARTBEAT", 2.0, "seconds between writes of the worker's health record",
                                 minimum=0.05)
    kv_headroom_gb: float | None = setting("MLXQ_KV_HEADROOM_GB", None, "GiB of KV cache the batches may hold, split "
                                           "evenly between the models", minimum=0.001,
                                           shown="75 % of the memory MLX may use, less the weights and prefix caches")
    prefix_cache_gb: float | None = setting("MLXQ_PREFIX_CACHE_GB", None, "GiB of cached prompt prefixes per model; "
                                            "0: off", minimum=0, shown="a tenth of memory, at most 4")
    kv_disk_gb: float = setting("MLXQ_KV_DISK_GB", 4.0, "GiB of cached prompt prefixes kept on disk per model (written "
                                "as they are cached, read back after a restart); 0: off", minimum=0)
    # (RUF009: setting() is a dataclasses.field, and a PerModel frozen: ruff knows neither)
    kv_bits: PerModel = setting(  # noqa: RUF009
        "MLXQ_KV_BITS", KV_OFF, "quantize the models' KV caches to 8 or 4 bits: their batch's rows, preempted rows "
        "and cached prefixes (8: about 1.9x the rows in the same memory, 4: 3.6x; sliding-window and recurrent layers "
        "stay as they are); per model by name: big=8,small=off, or 8,small=off (a value without a name: the models "
        "not named); 0: off", parse=lambda name, raw: _per_model(name, raw, _kv_bits, "8, 4 or off"), shown="off")
    kv_group_size: PerModel = setting(  # noqa: RUF009
        "MLXQ_KV_GROUP_SIZE", KV_GROUP_64, "values sharing one scale and bias in a quantized KV cache: 32, 64 or 128, "
        "dividing the model's head dimension; per model by name as MLXQ_KV_BITS (big=32,small=64)",
        parse=lambda name, raw: _per_model(name, raw, _kv_group_size, "32, 64, 128"), shown="64")
    kv_dir: str = setting("MLXQ_KV_DIR", "", "where the prefix cache on disk lives (a directory per model's weights "
                          "and KV layout)", shown="$XDG_CACHE_HOME/mlxq/kv (~/.cache/mlxq/kv)")
    affinity_wait_ms: float = setting("MLXQ_AFFINITY_WAIT_MS", 500.0, "a queued job whose prompt start another live "
                                      "worker's prefix cache holds waits at most this long for that worker, then "
                                      "any worker takes it (a worker always prefers jobs it holds)", minimum=0)
    priority_aging_s: float = shared(ClientConfig, "priority_aging_s")
    # One value for the whole process, whatever the models (engine/mlx/process.py).
    mlx_memory_gb: float | None = setting("MLXQ_MLX_MEMORY_GB", None, "GiB: MLX's memory limit, for the whole "
                                          "process", minimum=0.001, shown="MLX's default")
    mlx_cache_gb: float | None = setting("MLXQ_MLX_CACHE_GB", None, "GiB of freed buffers MLX keeps for reuse, for "
                                         "the whole process", minimum=0, shown="MLX's default")
    metrics_port: int = setting("MLXQ_METRICS_PORT", 0, "serve Prometheus metrics at http://ADDR:PORT/metrics; 0: "
                                "off", minimum=0)
    metrics_addr: str = setting("MLXQ_METRICS_ADDR", "0.0.0.0", "the address the metrics endpoint listens on")
    max_images: int = shared(ClientConfig, "max_images")
    max_image_bytes: int = shared(ClientConfig, "max_image_bytes")
    max_image_pixels: int = setting("MLXQ_MAX_IMAGE_PIXELS", 4096 * 4096, "one image's width x height, read from its "
                                    "header before decoding", minimum=1)
    image_urls: bool = setting("MLXQ_IMAGE_URLS", False, "1: fetch http(s) image URLs (else only data: URLs are "
                               "read)")
    image_fetch_timeout_s: float = setting("MLXQ_IMAGE_FETCH_TIMEOUT", 10.0, "seconds for one image's whole fetch",
                                           minimum=0.001)
    image_url_private: bool = setting("MLXQ_IMAGE_URL_PRIVATE", False, "1: fetch image URLs from loopback, private "
                                      "and link-local addresses too (else a job naming one ends error(bad_request): "
                                      "a job must not reach the worker's own network)")
    # Once started, redis-py's retries ride out a restart of Redis.
    connect_deadline_s: float = setting("MLXQ_CONNECT_DEADLINE", 30.0, "seconds a starting worker waits for Redis "
                                        "to answer, then exits 69 (its supervisor restarts it)", minimum=0)
    log_level: str = setting("MLXQ_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR; DEBUG adds start-up "
                             "failures' tracebacks", parse=lambda name, raw: _log_level(raw))
    worker_id: str = field(default_factory=_worker_id)

    @property
    def mlx_limits(self) -> tuple[int | None, int | None]:
        """MLX's process-wide memory and cache limits in bytes (None: MLX's default)."""
        def gib(v: float | None) -> int | None:
            return None if v is None else int(v * (1 << 30))

        return gib(self.mlx_memory_gb), gib(self.mlx_cache_gb)

    @property
    def served(self) -> tuple[ServedModel, ...]:
        """The models this worker serves: ``MLXQ_MODELS``, else ``MLXQ_MODEL`` (called ``MLXQ_MODEL_NAME``),
        loaded at start; then ``MLXQ_LOADABLE_MODELS``, loaded on demand."""
        loadable = parse_models(self.loadable_models, loadable=True)
        if self.models:
            return parse_models(self.models) + loadable
        pinned = (ServedModel(self.model, self.model_name or self.model, self.draft_model),) if self.model else ()
        return pinned + loadable

    def speculation(self, served: ServedModel) -> str:
        """How ``served`` speculates: "draft" (with its draft model), "ngram", or "" (it does not)."""
        if served.draft:
            return "draft"
        return "ngram" if self.speculate == "ngram" else ""

    def kv_quant(self, served: ServedModel) -> tuple[int, int] | None:
        """How ``served``'s KV cache is quantized: (bits, group size), or None: it is not."""
        bits = self.kv_bits.of(served.name)
        return (bits, self.kv_group_size.of(served.name)) if bits else None

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
        return cls(**read(cls, os.environ if env is None else env))


# Who reads which variables, in the reference table's order ("Read by": a variable both sides declare, shared(),
# is listed once with both).
SETTING_GROUPS: tuple[tuple[str, type], ...] = (
    ("producers", ClientConfig), ("gateway", GatewayConfig), ("workers", WorkerConfig), ("demo, bench", ToolConfig),
)


def _speculate(raw: str) -> str:
    mode = raw.strip().lower()
    if mode in ("off", "0", "none"):
        return ""
    if mode not in SPECULATE:
        raise ConfigError(f"MLXQ_SPECULATE={raw!r}: expected draft, ngram or off")
    return mode


def _model_kind(raw: str) -> str:
    kind = raw.strip().lower() or "auto"
    if kind not in MODEL_KINDS:
        raise ConfigError(f"MLXQ_MODEL_KIND={raw!r}: expected one of {', '.join(MODEL_KINDS)}")
    return kind


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
               "gib": 1 << 30, "tib": 1 << 40}


def parse_size(name: str, raw: str) -> int | None:
    """A size in bytes: ``24GiB``, ``1.5 GB``, ``512MiB``, ``1000000`` (bytes); empty: None (no bound)."""
    text = raw.strip().lower().replace(" ", "")
    if not text:
        return None
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise ConfigError(f"{name}={raw!r}: expected a size such as 24GiB, 512MiB or 1.5GB") from None
    if size <= 0:
        raise ConfigError(f"{name}={raw!r}: must be more than 0")
    return size


def _kv_bits(value: str) -> int | None:
    """One model's ``MLXQ_KV_BITS``: 8, 4, or 0 (off); None: not a value it takes."""
    mode = value.lower()
    if mode in ("", "off", "0", "none"):
        return 0
    return int(mode) if mode in KV_BITS else None


def _kv_group_size(value: str) -> int | None:
    """One model's ``MLXQ_KV_GROUP_SIZE``; None: not a size ``mx.quantize`` takes."""
    size = value or "64"
    return int(size) if size in KV_GROUP_SIZES else None


def _per_model(name: str, raw: str, parse: Callable[[str], int | None], expected: str) -> PerModel:
    """A :class:`PerModel` setting: one value (every model's), or ``model=value`` items and at most one value
    without a name (the other models'), comma-separated; each value read by ``parse`` (its default from "")."""
    items = [item.strip() for item in raw.split(",") if item.strip()] or [""]
    values: dict[str, int] = {}  # by model name; "": the models not named
    for item in items:
        model, eq, text = (part.strip() for part in item.rpartition("="))  # values hold no "=", a name might
        value = parse(text.lower())
        if value is None:
            where = f"{item}: " if eq or len(items) > 1 else ""
            raise ConfigError(f"{name}={raw!r}: {where}expected {expected}")
        if eq and not model:
            raise ConfigError(f"{name}={raw!r}: {item}: expected model=value (a model's name before the =)")
        if model in values:
            raise ConfigError(f"{name}={raw!r}: {model or 'the value for the models not named'} is given twice")
        values[model] = value
    default = values.pop("", None)
    return PerModel(cast(int, parse("")) if default is None else default, tuple(values.items()))


def _log_level(raw: str) -> str:
    level = raw.strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ConfigError(f"MLXQ_LOG_LEVEL={raw!r}: expected one of {', '.join(LOG_LEVELS)}")
    return level



def reference() -> str:
    """The operators' reference: every ``MLXQ_*`` variable of every side, as a Markdown table."""
    return markdown(SETTING_GROUPS)


if __name__ == "__main__":  # python3 -m mlxq.worker.config
    print(reference(), end="")
