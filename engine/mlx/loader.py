"""Load a model on its MLX thread and assemble its engine: mlx-lm for a language model, mlx-vlm for a
vision-language checkpoint (one whose config.json has a ``vision_config``), which then also takes images."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx_lm
from mlx_lm.utils import load_tokenizer

from ..core.backend import BatchBackend
from ..core.embedding import EmbeddingBackend, EmbeddingScheduler
from ..core.engine import Engine, Sink
from ..core.memory import DeviceMemory, KVBudget, KVLayout, default_headroom, default_prefix_cache_bytes, mib
from ..core.prompt import PromptEncoder
from ..core.scheduler import Scheduler
from ..core.speculation import SpecKind, Speculation
from ..core.stats import EngineStats
from .batch import MLXBatch
from .embedding import EmbeddingBatch, embedding_width, is_embedding_model, load_unprefixed
from .fixes import correct
from .memory import device_memory, measure_layout, model_bytes
from .prefix import directory as kv_directory
from .prefix.cache import PrefixCache
from .prefix.directory import layout_key, model_key, namespace
from .prefix.disk import PrefixDisk
from .process import mlx_process
from .quantized_cache import KVQuant, check_model, unquantized
from .ragged_cache import check_cache
from .sampling import make_request_logits_processors, make_request_sampler
from .speculation.batch import Proposer
from .speculation.proposers import DraftModel, PromptLookup
from .thread import MLXThread

if TYPE_CHECKING:
    from .vlm import Vision

__all__ = ["EngineOptions", "LoadedModel", "ModelLoadError", "build_embedding_engine", "build_engine",
           "draft_mismatch", "load_model",
           "locate_model", "memory_plan", "start_engine"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Batch shape, memory and scheduling of one engine."""

    capacity: int = 32  # sequences decoding at once
    prefill_batch_size: int = 8  # prompts prefilled together
    prefill_step_size: int = 512  # prompt tokens per prefill chunk (a step boundary between chunks)
    stream_interval_s: float = 0.0  # hold a request's tokens up to this long between outputs (see engine/core/pacer.py)
    stream_rate: float = 0.0  # most outputs a second; more rows than that allows: a longer interval (0: no bound)
    # KV bytes the batch's caches may hold (> 0); None: the default rule of engine/core/memory.py (75 % of usable
    # memory - weights - the prefix cache's bound)
    kv_headroom_bytes: int | None = None
    # the prefix cache's bound; None: a tenth of usable memory, at most 4 GiB; 0: no prefix cache
    prefix_cache_bytes: int | None = None
    aging_s: float = 1.0  # seconds of waiting worth one priority level (engine/core/waiting.py)
    # after the last interactive row, steps admit bulk requests one at a time for this long (at most a second:
    # engine/core/bulk.py)
    bulk_hold_s: float = 0.0
    # the share of the machine's memory the default rules give this engine (1/n with n engines in a process)
    memory_share: float = 1.0
    # speculative decoding (engine/mlx/speculation/batch.py); None: plain decoding
    speculation: Speculation | None = None
    # the prefix cache's tier on disk (engine/mlx/prefix/disk.py): its bound in bytes (0: off) and root directory
    # ("": kv_directory.default_dir())
    kv_disk_bytes: int = 0
    kv_dir: str = ""
    # what the model is: "auto" (an embedding model by its sentence-transformers files, else a chat model),
    # "chat", or "embedding" (engine/mlx/embedding.py)
    kind: str = "auto"
    # KV cache quantization of the batch's rows, parked rows and cached prefixes (engine/mlx/quantized_cache.py);
    # None: the model's own dtype
    kv_quant: KVQuant | None = None


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model and tokenizer as mlx-lm (or mlx-vlm) loaded them, plus what validation needs. ``vision`` is
    the image-prompt preparation of a vision-language model, None for a text-only one."""

    path: str
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    context_length: int | None
    eos_token_ids: frozenset[int]
    prompts: PromptEncoder
    vision: Vision | None = None
    embedding_width: int | None = None  # an embedding model's vector width (None: a model that generates)

    @property
    def accepts_images(self) -> bool:
        """Whether requests with images can run on this model."""
        return self.vision is not None


class ModelLoadError(Exception):
    """The model cannot be loaded or served as configured: a missing directory, not an mlx-lm model, an
    unsupported architecture, no memory left for its KV cache."""


def locate_model(path: str) -> str:
    """``path`` if it names a model mlx-lm can load: a local directory with a config.json, or a Hugging Face
    repo id (``org/name``). A path that looks local and does not exist is never sent to the hub."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"{path} is a file, not a model directory")
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an mlx-lm model directory (it has no config.json)")
        model_type = _local_config(local / "config.json").get("model_type")
        if not model_type:
            raise ModelLoadError(f"{path} is not an mlx-lm model directory (its config.json names no model_type)")
        return str(local)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1 or "\\" in path
    if looks_local:
        raise ModelLoadError(f"no model directory at {path}")
    return path  # org/name: mlx-lm fetches it from the hub (where the machine may download)


def _local_config(file: Path) -> dict[str, Any]:
    """A local config.json, or ModelLoadError naming the file and what is wrong with it."""
    try:
        config = json.loads(file.read_bytes())
    except OSError as exc:
        raise ModelLoadError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} is not a JSON object (it holds a {type(config).__name__})")
    return config


def load_model(path: str, kind: str = "auto") -> LoadedModel:
    """``mlx_lm.load``, or mlx-vlm's for a vision-language checkpoint (a local path, or a hub id on a machine
    that may download); ``kind``: as :attr:`EngineOptions.kind`. Run on the MLX thread."""
    t0 = time.perf_counter()
    try:
        model, tokenizer, config, vision = _load(locate_model(path), kind)
    except ModelLoadError:
        raise
    except ValueError as exc:  # mlx-lm's "Model type X not supported."
        raise ModelLoadError(f"cannot load the model at {path}: {exc}") from exc
    except Exception as exc:  # a download failing, a broken checkpoint
        if _not_cached_offline(exc):
            raise ModelLoadError(f"the model {path} is not in the local Hugging Face cache and the hub is unreachable "
                                 f"(or HF_HUB_OFFLINE is set): download it where there is a network (`hf download "
                                 f"{path}`) or set MLXQ_MODEL to a local directory") from exc
        raise ModelLoadError(f"cannot load the model at {path}: {type(exc).__name__}: {exc}") from exc
    correct(model)  # mlx-lm's layers that batch rows of different lengths wrongly (engine/mlx/fixes.py)
    text_config = config.get("text_config")
    text_config = text_config if isinstance(text_config, dict) else {}
    ctx = (config.get("max_position_embeddings") or config.get("max_seq_len")
           or text_config.get("max_position_embeddings"))
    width = _embedding_width(path, kind, model, vision is not None)
    loaded = LoadedModel(path, model, tokenizer, int(ctx) if ctx else None, frozenset(tokenizer.eos_token_ids),
                         PromptEncoder(tokenizer), vision, width)
    what = "vision-language " if vision else "embedding " if width is not None else ""
    log.info("loaded %smodel %s in %.2fs (context %s)", what, path, time.perf_counter() - t0, loaded.context_length)
    return loaded


def _embedding_width(path: str, kind: str, model: Any, vision: bool) -> int | None:
    """Its vectors' width if it is served as an embedding model (its files say so, or ``kind``), else None."""
    embeds = kind == "embedding" or (kind == "auto" and is_embedding_model(_local_path(path)))
    if not embeds:
        return None
    if vision or not hasattr(model, "model"):
        raise ModelLoadError(f"{path} cannot be served as an embedding model: mlxq embeds with mlx-lm decoder "
                             "models (last-token pooling) only")
    return embedding_width(model)


def _local_path(path: str) -> str:
    """A checkpoint's local directory (a hub id's in the local cache; the id itself when it is not there)."""
    if Path(path).exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, local_files_only=True))
    except Exception:  # not cached: mlx-lm's load failed already, or it has no local files
        return path


def _not_cached_offline(exc: BaseException) -> bool:
    """Whether a hub id failed to load because it is not cached and the hub cannot be reached."""
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return False
    return isinstance(exc, LocalEntryNotFoundError) or isinstance(exc.__cause__, LocalEntryNotFoundError)


def _load(path: str, kind: str = "auto") -> tuple[Any, Any, dict[str, Any], Vision | None]:
    """The model, mlx-lm's tokenizer wrapper, config.json, and the vision half of a vision-language model."""
    config = read_config(path)
    if not is_vision_config(config):
        try:
            model, tokenizer, config = mlx_lm.load(path, return_config=True)  # type: ignore[misc]
        except ValueError as exc:  # an embedding checkpoint stored without the "model." prefix (as HF's)
            local = _local_path(path)
            embeds = kind == "embedding" or (kind == "auto" and is_embedding_model(local))
            if not embeds or "parameters not in model" not in str(exc):
                raise
            model, tokenizer, config = load_unprefixed(local)
        return model, tokenizer, config, None
    try:
        from .vlm import load_vision_model  # imports mlx-vlm: only a vision-language worker pays for it
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "mlx_vlm":
            raise
        raise ModelLoadError(f"{path} is a vision-language model: serving it needs mlx-vlm, which the vision extra "
                             "installs (pip install 'mlxq[vision]')") from None

    model, vision = load_vision_model(path)
    # mlx-lm's tokenizer wrapper, as a text model's: the same prompt encoding and streaming detokenizer.
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))  # a hub id too
    return model, tokenizer, config, vision


def is_vision_config(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config.json describes a vision-language model (it has a vision tower)."""
    return isinstance(config.get("vision_config"), dict)


def read_config(path: str) -> dict[str, Any]:
    """config.json of a checkpoint: a local directory's, or a hub model's (downloading only that file).
    {} when unreadable: the load that follows then reports the real problem."""
    local = Path(path)
    try:
        if not local.exists():
            from huggingface_hub import hf_hub_download

            local = Path(hf_hub_download(path, "config.json")).parent
        config = json.loads((local / "config.json").read_text())
    except Exception:  # a missing file, a bad id, no network: mlx_lm.load says which
        return {}
    return config if isinstance(config, dict) else {}


async def start_engine(path: str, sink: Sink, options: EngineOptions | None = None, thread: MLXThread | None = None
                       ) -> tuple[Engine, LoadedModel]:
    """Start an MLX thread (or use ``thread``, not started yet), load the model on it, and build the engine around
    a fresh batch."""
    thread = thread or MLXThread(name="mlx-" + path.rstrip("/").rsplit("/", 1)[-1])
    try:
        loaded = await thread.call(load_model, path, (options or EngineOptions()).kind)
        if loaded.embedding_width is not None:
            return await build_embedding_engine(loaded, thread, sink, options), loaded
        return await build_engine(loaded, thread, sink, options), loaded
    except BaseException:  # a thread left running aborts the process at exit
        await thread.aclose()
        raise


async def build_engine(loaded: LoadedModel, thread: MLXThread, sink: Sink, options: EngineOptions | None = None
                       ) -> Engine:
    """The engine of a model loaded on ``thread``: scheduler, batch, detokenizers, sampling."""
    opts = options or EngineOptions()
    mlx_process()  # the process's wired limit, set once before any batch runs (a worker made it first)
    opts = dataclasses.replace(opts, kv_quant=await _kv_quant(loaded, thread, opts))
    draft = await _load_draft(loaded, thread, opts.speculation)
    stats = EngineStats()

    def make_backend() -> BatchBackend:
        if loaded.vision is not None:  # image and text rows in one mlx-vlm batch (see engine/mlx/vlm.py)
            from .vlm import VLMBatch

            return VLMBatch(loaded.model, loaded.vision.processor, loaded.eos_token_ids, capacity=opts.capacity,
                            prefill_batch_size=opts.prefill_batch_size, prefill_step_size=opts.prefill_step_size,
                            stream=thread.stream)
        return MLXBatch(
            loaded.model,
            loaded.eos_token_ids,
            capacity=opts.capacity,
            prefill_batch_size=opts.prefill_batch_size,
            prefill_step_size=opts.prefill_step_size,
            stream=thread.stream,
            proposer=_proposer(opts, draft),
            max_k=opts.speculation.max_k if opts.speculation else 0,
            stats=stats,
            kv_quant=opts.kv_quant,
        )

    backend = await thread.call(make_backend)
    caches = bool(getattr(backend, "supports_caches", False))
    layout = await thread.call(measure_layout, loaded.model, opts.prefill_step_size, opts.kv_quant)
    draft_bytes = 0
    if draft is not None:  # every row holds a draft cache too: a token costs both models' KV
        extra = await thread.call(measure_layout, draft.model, opts.prefill_step_size)
        layout = dataclasses.replace(layout, bytes_per_token=layout.bytes_per_token + extra.bytes_per_token)
        draft_bytes = model_bytes(draft.model)
    device = device_memory()
    stats.device = device.describe()
    memory, prefix = memory_plan(loaded, layout, opts, device, caches=caches, draft_bytes=draft_bytes)
    if prefix is not None and opts.kv_disk_bytes > 0:
        prefix.disk = await _prefix_disk(loaded, thread, opts)
    scheduler = Scheduler(
        backend,
        capacity=opts.capacity,
        new_detokenizer=_detokenizers(loaded),
        make_sampler=make_request_sampler,
        make_processors=make_request_logits_processors,
        memory=memory,
        prefix_cache=prefix,
        aging_s=opts.aging_s,
        context_length=loaded.context_length,
        stats=stats,
        bulk_hold_s=opts.bulk_hold_s,
    )
    return Engine(thread, scheduler, sink, make_backend=make_backend, stream_interval_s=opts.stream_interval_s,
                  prefill_batch=opts.prefill_batch_size, stream_rate=opts.stream_rate)


async def build_embedding_engine(loaded: LoadedModel, thread: MLXThread, sink: Sink,
                                 options: EngineOptions | None = None) -> Engine:
    """The engine of an embedding model loaded on ``thread``: its requests' inputs batched into forward passes
    (engine/core/embedding.py), up to ``capacity`` inputs and ``capacity x prefill_step_size`` padded tokens a
    pass; an idle engine waits for a burst of up to ``capacity`` requests (the admission window) before a pass."""
    opts = options or EngineOptions()
    if opts.speculation is not None:
        raise ModelLoadError(f"{loaded.path} is an embedding model: it does not decode, so it cannot speculate "
                             "(unset MLXQ_SPECULATE and MLXQ_DRAFT_MODEL for it)")
    mlx_process()
    stats = EngineStats()
    stats.device = device_memory().describe()

    def make_backend() -> EmbeddingBackend:
        return EmbeddingBatch(loaded.model, thread.stream)

    backend = await thread.call(make_backend)
    scheduler = EmbeddingScheduler(backend, capacity=opts.capacity, max_rows=opts.capacity,
                                   max_tokens=opts.capacity * opts.prefill_step_size, stats=stats)
    return Engine(thread, scheduler, sink, make_backend=make_backend, prefill_batch=opts.capacity)


async def _prefix_disk(loaded: LoadedModel, thread: MLXThread, opts: EngineOptions) -> PrefixDisk | None:
    """The prefix cache's tier on disk, in a directory named by the model's weights (and its draft's) and its KV
    layout; None (logged) when the weights cannot be told apart (no local files)."""
    paths = [loaded.path] + ([opts.speculation.draft] if opts.speculation and opts.speculation.draft else [])
    keys = [await asyncio.to_thread(model_key, p) for p in paths]
    if any(k is None for k in keys):
        log.warning("prefix cache on disk off for %s: its weights are not local files to name its entries by",
                    loaded.path)
        return None
    layout = await thread.call(layout_key, loaded.model, opts.kv_quant)
    root = Path(opts.kv_dir).expanduser() if opts.kv_dir else kv_directory.default_dir()
    directory = namespace(root, "+".join(k for k in keys if k), layout)
    disk = await asyncio.to_thread(PrefixDisk, directory, opts.kv_disk_bytes)
    log.info("prefix cache on disk for %s: %s, at most %s", loaded.path, directory, mib(opts.kv_disk_bytes))
    return disk


async def _kv_quant(loaded: LoadedModel, thread: MLXThread, opts: EngineOptions) -> KVQuant | None:
    """The KV quantization the engine of ``loaded`` runs with: ``opts``' once checked against the model
    (ModelLoadError when it cannot be), None for a vision-language model (mlx-vlm's batch makes its own caches),
    logged with the layers it leaves as they are."""
    quant = opts.kv_quant
    if quant is None:
        return None
    if loaded.vision is not None:
        log.warning("KV cache of %s not quantized: mlxq quantizes mlx-lm models' caches, not mlx-vlm's",
                    loaded.path)
        return None
    problem = await thread.call(check_model, loaded.model, quant)
    if problem is not None:
        raise ModelLoadError(f"cannot quantize the KV cache of {loaded.path} to {quant.bits} bits in groups of "
                             f"{quant.group_size}: {problem} (MLXQ_KV_BITS, MLXQ_KV_GROUP_SIZE)")
    kept = await thread.call(unquantized, loaded.model)
    log.info("KV cache of %s quantized to %d bits in groups of %d%s", loaded.path, quant.bits, quant.group_size,
             f"; not quantized: its {', '.join(kept)} layers (sliding windows and recurrent state stay as they are)"
             if kept else "")
    return quant


async def _load_draft(loaded: LoadedModel, thread: MLXThread, spec: Speculation | None) -> LoadedModel | None:
    """The draft model of ``spec``, loaded on the target's thread and checked against it; None without one."""
    if spec is None:
        return None
    if loaded.vision is not None:
        raise ModelLoadError(f"{loaded.path} is a vision-language model: mlxq speculates only for mlx-lm models "
                             "(unset MLXQ_SPECULATE and MLXQ_DRAFT_MODEL for it)")
    problem = await thread.call(check_cache, loaded.model)
    if problem is not None:
        raise ModelLoadError(f"cannot speculate with {loaded.path}: {problem}")
    if spec.kind is not SpecKind.DRAFT:
        return None
    if not spec.draft:
        raise ModelLoadError("speculative decoding with a draft model needs its path (MLXQ_DRAFT_MODEL)")
    try:
        draft = await thread.call(load_model, spec.draft)
    except ModelLoadError as exc:
        raise ModelLoadError(f"draft model: {exc}") from exc
    problem = draft_mismatch(loaded, draft) or await thread.call(check_cache, draft.model)
    if problem is not None:
        raise ModelLoadError(f"draft model {spec.draft} cannot draft for {loaded.path}: {problem}")
    log.info("speculative decoding for %s with the draft model %s (up to %d tokens per step)", loaded.path,
             spec.draft, spec.max_k)
    return draft


def draft_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
    """Why ``draft`` cannot propose tokens to ``target`` (None: it can): it must share its vocabulary."""
    if draft.vision is not None:
        return "it is a vision-language model"
    ours, theirs = target.tokenizer.vocab, draft.tokenizer.vocab
    if ours != theirs:
        differ = sum(1 for t, i in theirs.items() if ours.get(t) != i) + sum(1 for t in ours if t not in theirs)
        return f"its vocabulary differs ({len(theirs)} tokens against {len(ours)}, {differ} differ)"
    if draft.eos_token_ids != target.eos_token_ids:
        return (f"its end-of-sequence tokens differ ({sorted(draft.eos_token_ids)} against "
                f"{sorted(target.eos_token_ids)})")
    return None


def _proposer(opts: EngineOptions, draft: LoadedModel | None) -> Proposer | None:
    """A fresh proposer for a new batch (a batch made again after a failure starts with empty caches)."""
    if opts.speculation is None:
        return None
    if draft is not None:
        return DraftModel(draft.model, opts.prefill_step_size)
    return PromptLookup()


def _detokenizers(loaded: LoadedModel) -> Callable[[], Any]:
    """What makes each sequence's streaming detokenizer: mlx-vlm's own for a vision-language model (so its text
    is mlx-vlm's), else mlx-lm's."""
    if loaded.vision is not None:
        return loaded.vision.new_detokenizer
    return lambda: loaded.tokenizer.detokenizer


def memory_plan(loaded: LoadedModel, layout: KVLayout, opts: EngineOptions, device: DeviceMemory, *,
                caches: bool = True, draft_bytes: int = 0) -> tuple[KVBudget, PrefixCache | None]:
    """The KV budget and the prefix cache of an engine on ``device``, from its options or the defaults of
    engine/core/memory.py. A backend that cannot hand caches out (``caches=False``, mlx-vlm's) has no prefix cache, so
    the default headroom reserves nothing for one."""
    usable = int(device.usable * opts.memory_share)
    prefix_bytes = opts.prefix_cache_bytes
    if not caches:
        prefix_bytes = 0
    elif prefix_bytes is None:
        prefix_bytes = default_prefix_cache_bytes(usable)
    headroom = opts.kv_headroom_bytes
    if headroom is None:
        headroom = default_headroom(usable, model_bytes(loaded.model) + draft_bytes, prefix_bytes, layout,
                                    loaded.context_length)
    if headroom <= 0:
        raise ModelLoadError(f"the KV headroom for {loaded.path} must be positive, not {headroom} bytes "
                             "(MLXQ_KV_HEADROOM_GB, or less weights for the memory)")
    full = layout.row_bytes(loaded.context_length or 0)
    if loaded.context_length and full > headroom:
        log.warning("a full-context sequence (%d tokens) needs %s of KV cache, more than the headroom %s: longer "
                    "requests will be refused", loaded.context_length, mib(full), mib(headroom))
    log.info("model %s on %s: KV cache %d bytes per token (%d-token steps), %s of fixed state per sequence; "
             "headroom %s; prefix cache %s", loaded.path, device.describe(), layout.per_token_bytes, layout.step,
             mib(layout.fixed_bytes), mib(headroom), mib(prefix_bytes) if prefix_bytes > 0 else "off")
    return KVBudget(headroom, layout), PrefixCache(prefix_bytes) if prefix_bytes > 0 else None
