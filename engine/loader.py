"""Load a model with mlx-lm on its MLX thread and assemble its engine."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx_lm

from .batch import MLXBatch
from .engine import Engine, Sink
from .memory import (
    KVBudget,
    KVLayout,
    default_headroom,
    default_prefix_cache_bytes,
    measure_layout,
    mib,
    model_bytes,
    usable_memory_bytes,
)
from .mlx_thread import MLXThread
from .prefix_cache import PrefixCache
from .prompt import PromptEncoder
from .sampling import make_request_logits_processors, make_request_sampler
from .scheduler import Scheduler

__all__ = ["EngineOptions", "LoadedModel", "build_engine", "load_model", "memory_plan", "start_engine"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Batch shape, memory and scheduling of one engine."""

    capacity: int = 32  # sequences decoding at once
    prefill_batch_size: int = 8  # prompts prefilled together
    prefill_step_size: int = 512  # prompt tokens per prefill chunk (a step boundary between chunks)
    stream_interval_s: float = 0.0  # hold a request's tokens up to this long between outputs (see pacer.py)
    # KV bytes the batch's caches may hold (> 0); None: the default rule of engine/memory.py (75 % of usable
    # memory - weights - the prefix cache's bound)
    kv_headroom_bytes: int | None = None
    # the prefix cache's bound; None: a tenth of usable memory, at most 4 GiB; 0: no prefix cache
    prefix_cache_bytes: int | None = None
    aging_s: float = 1.0  # seconds of waiting worth one priority level (engine/waiting.py)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model and tokenizer as mlx-lm loaded them, plus what validation needs."""

    path: str
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_length: int | None
    eos_token_ids: frozenset[int]
    prompts: PromptEncoder


def load_model(path: str) -> LoadedModel:
    """``mlx_lm.load`` (a local path, or a hub id on a machine that may download). Run on the MLX thread."""
    t0 = time.perf_counter()
    model, tokenizer, config = mlx_lm.load(path, return_config=True)  # type: ignore[misc]
    ctx = config.get("max_position_embeddings") or config.get("max_seq_len")
    loaded = LoadedModel(path, model, tokenizer, int(ctx) if ctx else None, frozenset(tokenizer.eos_token_ids),
                         PromptEncoder(tokenizer))
    log.info("loaded model %s in %.2fs (context %s)", path, time.perf_counter() - t0, loaded.context_length)
    return loaded


async def start_engine(path: str, sink: Sink, options: EngineOptions | None = None) -> tuple[Engine, LoadedModel]:
    """Start an MLX thread, load the model on it, and build the engine around a fresh batch."""
    thread = MLXThread(name="mlx-" + path.rstrip("/").rsplit("/", 1)[-1])
    loaded = await thread.call(load_model, path)
    return await build_engine(loaded, thread, sink, options), loaded


async def build_engine(loaded: LoadedModel, thread: MLXThread, sink: Sink, options: EngineOptions | None = None
                       ) -> Engine:
    """The engine of a model loaded on ``thread``: scheduler, batch, detokenizers, sampling."""
    opts = options or EngineOptions()

    def make_backend() -> MLXBatch:
        return MLXBatch(
            loaded.model,
            loaded.eos_token_ids,
            capacity=opts.capacity,
            prefill_batch_size=opts.prefill_batch_size,
            prefill_step_size=opts.prefill_step_size,
            stream=thread.stream,
        )

    backend = await thread.call(make_backend)
    memory, prefix = memory_plan(loaded, await thread.call(measure_layout, loaded.model), opts)
    scheduler = Scheduler(
        backend,
        capacity=opts.capacity,
        new_detokenizer=lambda: loaded.tokenizer.detokenizer,
        make_sampler=make_request_sampler,
        make_processors=make_request_logits_processors,
        memory=memory,
        prefix_cache=prefix,
        aging_s=opts.aging_s,
        context_length=loaded.context_length,
    )
    return Engine(thread, scheduler, sink, make_backend=make_backend, stream_interval_s=opts.stream_interval_s,
                  prefill_batch=opts.prefill_batch_size)


def memory_plan(loaded: LoadedModel, layout: KVLayout, opts: EngineOptions) -> tuple[KVBudget, PrefixCache | None]:
    """The KV budget and the prefix cache of an engine, from its options or the defaults of engine/memory.py."""
    usable = usable_memory_bytes()
    prefix_bytes = opts.prefix_cache_bytes
    if prefix_bytes is None:
        prefix_bytes = default_prefix_cache_bytes(usable)
    headroom = opts.kv_headroom_bytes
    if headroom is None:
        headroom = default_headroom(usable, model_bytes(loaded.model), prefix_bytes, layout, loaded.context_length)
    if headroom <= 0:
        raise ValueError(f"the KV headroom must be positive, not {headroom} bytes")
    full = layout.row_bytes(loaded.context_length or 0)
    if loaded.context_length and full > headroom:
        log.warning("a full-context sequence (%d tokens) needs %s of KV cache, more than the headroom %s: longer "
                    "requests will be refused", loaded.context_length, mib(full), mib(headroom))
    log.info("KV cache: %d bytes per token (%d-token steps); headroom %s; prefix cache %s", layout.bytes_per_token,
             layout.step, mib(headroom), mib(prefix_bytes) if prefix_bytes > 0 else "off")
    return KVBudget(headroom, layout), PrefixCache(prefix_bytes) if prefix_bytes > 0 else None
