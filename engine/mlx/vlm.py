"""Vision-language models on mlx-vlm (an MLX adapter): the runtime's one file that touches mlx-vlm (pinned: its
BatchGenerator's API moves between minors).

- :class:`Vision`: an image prompt's CPU half (chat template, the processor's work, image-token expansion), in
  any thread, making no MLX array: token ids and numpy arrays (:class:`~engine.core.request.ImageInputs`).
- :class:`VLMBatch`: mlx-vlm's ``BatchGenerator`` as the scheduler's ``BatchBackend``
  (``engine/core/backend.py``). Every row carries input embeddings, so image and text rows share one batch; an
  idle engine embeds a burst's arrivals as they come (:meth:`VLMBatch.embed_ahead`).

Done here, not by mlx-vlm 0.7: per-request sampling (a non-greedy row's sampler is its last logits processor,
:class:`RowSampler`), admission up to capacity (``completion_batch_size = capacity + prefill_batch_size``), and
a cancel mid-prefill that would leave one padded row (:meth:`VLMBatch.remove`). No KV cache is handed back
(``supports_caches`` is False).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.generate.ar import BatchGenerator
from mlx_vlm.prompt_utils import apply_chat_template
from mlx_vlm.utils import load as vlm_load
from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

from ..core.backend import GeneratedToken, LogprobsAsked
from ..core.request import ImageInputs
from .batch import attach_logprobs
from .process import unwired

__all__ = ["RowSampler", "VLMBatch", "Vision", "load_vision_model"]

SUPPORTED = "0.7"  # BatchGenerator's API and the prefill state VLMBatch.remove reads are 0.7's
if not importlib.metadata.version("mlx-vlm").startswith(SUPPORTED + "."):
    raise ImportError(f"mlxq needs mlx-vlm {SUPPORTED}.x; mlx-vlm {importlib.metadata.version('mlx-vlm')} is "
                      f"installed: pip install 'mlx-vlm=={SUPPORTED}.*'")

_AR = importlib.import_module("mlx_vlm.generate.ar")  # the module (``mlx_vlm.generate`` is also a function)
_TOKEN_KEYS = ("input_ids", "attention_mask")  # the processor's outputs the prompt tokens stand for


def load_vision_model(path: str | Path) -> tuple[Any, Vision]:
    """``mlx_vlm.load``: the model and the :class:`Vision` around its processor. Run on the MLX thread."""
    model, processor = vlm_load(str(path))
    return model, Vision(model, processor)


class _ProcessorKwargsNotice(logging.Filter):
    """mlx-vlm 0.7.10 renders chat prompts passing the processor keyword arguments transformers 5 warns about
    on every call: a line per image job in a worker's log about nothing its operator can change."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "have to be in `processor_kwargs`" not in record.getMessage()


logging.getLogger("transformers.processing_utils").addFilter(_ProcessorKwargsNotice())


class Vision:
    """A model's image-prompt preparation: what runs before the engine, off its thread (CPU only).

    ``prepare`` is safe from any thread: calls are serialised, since the processor's tokenizer changes its
    padding state per call.
    """

    def __init__(self, model: Any, processor: Any) -> None:
        self.processor = processor
        self._config = model.config
        self._image_token_index = getattr(model.config, "image_token_index", None)
        self._add_special = should_add_special_tokens(model.config.model_type, processor)
        self._lock = threading.Lock()

    def new_detokenizer(self) -> Any:
        """A streaming detokenizer of the kind mlx-vlm renders this model's tokens with (its own, not mlx-lm's:
        they differ on a first token's leading space, byte 0x00 and incomplete UTF-8)."""
        detokenizer = copy.copy(self.processor.detokenizer)
        detokenizer.reset()
        return detokenizer

    def render(self, messages: list[dict[str, Any]], num_images: int) -> str:
        """The chat prompt of ``messages`` (content parts, an image as ``{"type": "image"}``) as mlx-vlm
        renders it."""
        return str(apply_chat_template(self.processor, self._config, messages, num_images=num_images))

    def prepare(self, messages: list[dict[str, Any]], images: Sequence[Any]) -> tuple[list[int], ImageInputs]:
        """Render, resize and patch the images, expand their placeholder tokens: the prompt's token ids and
        its images' arrays (numpy), as mlx-vlm's ``stream_generate`` prepares them. PIL images in, in the
        order the messages hold them."""
        prompt = self.render(messages, len(images))
        with self._lock:
            inputs = prepare_inputs(self.processor, images=list(images), prompts=prompt,
                                    image_token_index=self._image_token_index, add_special_tokens=self._add_special)
        # mlx-vlm's processors hand back MLX arrays built from numpy (no computation): numpy again here, so
        # nothing MLX crosses to the engine thread.
        tokens = [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)]
        arrays = {k: _to_numpy(v) for k, v in inputs.items() if k not in _TOKEN_KEYS and v is not None}
        return tokens, ImageInputs(arrays, len(images))


def _to_numpy(value: Any) -> Any:
    return np.asarray(value) if isinstance(value, mx.array) else value


class RowSampler:
    """A row's own sampler, as the last of its logits processors (see the module docstring).

    It turns the row's logits into log-probabilities (what mlx-lm samplers take), samples, and returns
    logits that are -inf everywhere but the sampled token. ``process_last_token`` is the form mlx-vlm calls
    while decoding (no token history needed); the call form is used for a sequence's first token.
    """

    def __init__(self, sampler: Callable[[mx.array], mx.array]) -> None:
        self._sampler = sampler

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self._pick(logits)

    def process_last_token(self, token: int, logits: mx.array) -> mx.array:
        return self._pick(logits)

    def _pick(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self._sampler(logprobs)
        hit = mx.arange(logits.shape[-1]) == token.reshape(-1, 1)
        return mx.where(hit, mx.array(0.0, dtype=logits.dtype), mx.array(-mx.inf, dtype=logits.dtype))


class VLMBatch:
    """mlx-vlm's BatchGenerator behind ``BatchBackend``: text and image rows in one batch.

    A step runs one decode step for the generating sequences, then one chunk (``prefill_step_size``
    columns) of the prompt batch being prefilled, so a long prompt spans several steps and can be
    cancelled between them. Every method must be called on the model's MLX thread.
    """

    def __init__(
        self,
        model: Any,
        processor: Any,
        eos_token_ids: Iterable[int],
        *,
        capacity: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        stream: mx.Stream,
    ) -> None:
        self._model = model
        self._doomed: set[int] = set()  # removed by the scheduler, left in mlx-vlm's prefill (see remove)
        prefill = min(prefill_batch_size, capacity)
        # Rows embedded before their insert, by id of their prompt list (held here, so the id stays theirs):
        # at most a prefill batch, kept until the next step; a row whose entry is gone (not admitted then, its
        # request aborted) is embedded at its insert.
        self._ahead: dict[int, tuple[list[int], ImageInputs | None, dict[str, Any]]] = {}
        self._ahead_max = prefill
        # mlx-vlm's generator enters ``wired_limit()`` in __init__ (setting the wired limit) and leaves it in
        # close(), restoring the limit it found: out of order with several generators (engine/mlx/process.py,
        # which sets it once per process). Made unwired, it enters a context that does nothing.
        with unwired(_AR, "wired_limit", _no_wired_limit):
            self._gen = BatchGenerator(
                model.language_model,
                processor,
                stop_tokens=set(eos_token_ids),
                completion_batch_size=capacity + prefill,  # see the module docstring: admission up to capacity
                prefill_batch_size=prefill,
                prefill_step_size=prefill_step_size,
                compute_logprobs=False,  # nothing reads them
                stream=stream,
            )

    @property
    def supports_caches(self) -> bool:
        """False: mlx-vlm's batch cannot hand a sequence's KV cache back (no prefix cache, no resume)."""
        return False

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        images: ImageInputs | None = None,
    ) -> int:
        processors = [*logits_processors, RowSampler(sampler)] if sampler is not None else list(logits_processors)
        (uid,) = self._gen.insert([prompt], max_tokens=[max_tokens], prompt_kwargs=[self._embedded(prompt, images)],
                                  logits_processors=[processors])
        return int(uid)

    def embed_ahead(self, prompt: list[int], images: ImageInputs | None) -> None:
        """Embed a row now and evaluate it, for its insert to take (the engine calls this while it waits for
        the rest of a burst, when its thread would idle). A row that cannot be embedded is left to its insert,
        which reports why."""
        try:
            kwargs = self._embed(prompt, images)
            mx.eval([v for v in kwargs.values() if isinstance(v, mx.array)])
        except Exception:  # the insert embeds it again and fails the request with the reason
            return
        self._ahead[id(prompt)] = (prompt, images, kwargs)
        while len(self._ahead) > self._ahead_max:
            del self._ahead[next(iter(self._ahead))]  # the oldest

    def _embedded(self, prompt: list[int], images: ImageInputs | None) -> dict[str, Any]:
        """The row's prompt kwargs: embedded ahead for this very prompt and images, or now."""
        entry = self._ahead.pop(id(prompt), None)
        if entry is not None and entry[0] is prompt and entry[1] is images:
            return entry[2]
        return self._embed(prompt, images)

    def _embed(self, prompt: list[int], images: ImageInputs | None) -> dict[str, Any]:
        """The row's prompt kwargs: its input embeddings (and the model's extras, e.g. mrope positions), lazy.
        The vision tower runs when the row's prefill is evaluated."""
        ids = mx.array([prompt])
        given = images.arrays if images is not None else {}
        arrays = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in given.items()}
        pixel_values = arrays.pop("pixel_values", None)
        try:
            embedded = self._model.get_input_embeddings(ids, pixel_values, mask=mx.ones_like(ids), **arrays)
        except (ValueError, IndexError, TypeError) as exc:  # the request's images do not fit its prompt
            raise ValueError(f"could not embed the prompt: {exc}") from exc
        return {**arrays, **{k: v for k, v in embedded.to_dict().items() if v is not None}}

    def remove(self, uids: Iterable[int]) -> None:
        for uid in uids:
            if self._leaves_padded_row(uid):
                self._doomed.add(uid)
            else:
                self._gen.remove(uid)

    def _leaves_padded_row(self, uid: int) -> bool:
        """Whether removing ``uid`` now would leave a one-row prompt batch whose left padding is not all
        prefilled yet. mlx-vlm 0.7.10 then decodes that row at shifted positions: its qwen2_vl-style models
        take a one-row batch's position from the cache's buffer index, padding included (``language.py``,
        ``cache_position_offset``). Such a row leaves when its prefill is done instead (the scheduler has
        already ended its request and ignores its tokens): one more row in a few prefill steps."""
        batch = self._gen._prompt_batch  # mlx-vlm's own state; pinned (see the module docstring)
        if batch is None or uid not in batch.uids or len(batch.uids) != 2:
            return False
        other = 1 - batch.uids.index(uid)
        return int(batch._left_padding_per_row[other]) > int(batch._processed_prompt_columns)

    def step(self) -> Sequence[GeneratedToken]:
        self._ahead.clear()  # the scheduler has inserted what it admits: the rest are not soon
        _, generated = self._gen.next()
        if self._doomed:
            self._drop_prefilled()
        return generated  # type: ignore[no-any-return]

    def _drop_prefilled(self) -> None:
        batch = self._gen._prompt_batch
        for uid in [u for u in self._doomed if batch is None or u not in batch.uids]:
            self._doomed.discard(uid)
            self._gen.remove(uid)

    def attach_logprobs(self, asked: list[LogprobsAsked]) -> None:
        attach_logprobs(asked)

    def close(self) -> None:
        self._gen.close()


def _no_wired_limit(model: Any, streams: Any = None) -> contextlib.AbstractContextManager[None]:
    """mlx-vlm's ``wired_limit(model, streams)`` when the process owns the limit: a context doing nothing."""
    return contextlib.nullcontext()

