"""Load a model with mlx-lm on its MLX thread and assemble its engine."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx_lm

from .batch import MLXBatch
from .engine import Engine, Sink
from .mlx_thread import MLXThread
from .prompt import PromptEncoder
from .sampling import make_request_logits_processors, make_request_sampler
from .scheduler import Scheduler

__all__ = ["EngineOptions", "LoadedModel", "ModelLoadError", "build_engine", "load_model", "locate_model",
           "start_engine"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Batch shape of one engine."""

    capacity: int = 32  # sequences decoding at once
    prefill_batch_size: int = 8  # prompts prefilled together
    prefill_step_size: int = 512  # prompt tokens per prefill chunk (a step boundary between chunks)
    stream_interval_s: float = 0.0  # hold a request's tokens up to this long between outputs (see pacer.py)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model and tokenizer as mlx-lm loaded them, plus what validation needs."""

    path: str
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_length: int | None
    eos_token_ids: frozenset[int]
    prompts: PromptEncoder


class ModelLoadError(Exception):
    """The model cannot be loaded: a missing directory, not an mlx-lm model, an unsupported architecture."""


def locate_model(path: str) -> str:
    """``path`` if it names a model mlx-lm can load: a local directory with a config.json, or a Hugging Face
    repo id (``org/name``). A path that looks local and does not exist is never sent to the hub."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"{path} is a file, not a model directory")
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an mlx-lm model directory (it has no config.json)")
        model_type = json.loads((local / "config.json").read_text()).get("model_type")
        if not model_type:
            raise ModelLoadError(f"{path} is not an mlx-lm model directory (its config.json names no model_type)")
        return str(local)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1 or "\\" in path
    if looks_local:
        raise ModelLoadError(f"no model directory at {path}")
    return path  # org/name: mlx-lm fetches it from the hub (where the machine may download)


def load_model(path: str) -> LoadedModel:
    """``mlx_lm.load`` (a local path, or a hub id on a machine that may download). Run on the MLX thread."""
    t0 = time.perf_counter()
    try:
        model, tokenizer, config = mlx_lm.load(locate_model(path), return_config=True)  # type: ignore[misc]
    except ModelLoadError:
        raise
    except ValueError as exc:  # mlx-lm's "Model type X not supported."
        raise ModelLoadError(f"cannot load the model at {path}: {exc}") from exc
    except Exception as exc:  # a download failing, a broken checkpoint
        raise ModelLoadError(f"cannot load the model at {path}: {type(exc).__name__}: {exc}") from exc
    ctx = config.get("max_position_embeddings") or config.get("max_seq_len")
    loaded = LoadedModel(path, model, tokenizer, int(ctx) if ctx else None, frozenset(tokenizer.eos_token_ids),
                         PromptEncoder(tokenizer))
    log.info("loaded model %s in %.2fs (context %s)", path, time.perf_counter() - t0, loaded.context_length)
    return loaded


async def start_engine(path: str, sink: Sink, options: EngineOptions | None = None) -> tuple[Engine, LoadedModel]:
    """Start an MLX thread, load the model on it, and build the engine around a fresh batch."""
    thread = MLXThread(name="mlx-" + path.rstrip("/").rsplit("/", 1)[-1])
    try:
        loaded = await thread.call(load_model, path)
    except BaseException:
        await thread.aclose()
        raise
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
    scheduler = Scheduler(
        backend,
        capacity=opts.capacity,
        new_detokenizer=lambda: loaded.tokenizer.detokenizer,
        make_sampler=make_request_sampler,
        make_processors=make_request_logits_processors,
    )
    return Engine(thread, scheduler, sink, make_backend=make_backend, stream_interval_s=opts.stream_interval_s,
                  prefill_batch=opts.prefill_batch_size)
