"""mlx-lm's ``BatchGenerator`` behind the scheduler's backend (an MLX adapter; its API moves between minors: mlx-lm
is pinned). The protocols it implements are ``engine/core/backend.py``'s, which import no MLX.

``MLXBatch`` exposes the small surface the scheduler needs: insert a prompt, remove sequences, run one
step; and, for the prefix cache and preemption (:class:`CachingBackend`), insert with a KV cache, take a
sequence out with its cache, report the caches' bytes and the caches checkpointed at a prompt boundary.
Every method must be called on the model's MLX thread.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from ..core.backend import GeneratedToken, LogprobsAsked, SequenceCache, Started
from ..core.request import ImageInputs, TokenLogprob
from ..core.speculation.tuner import Tuner
from ..core.stats import EngineStats
from .constrain import RowMask
from .generation import masked
from .process import unwired
from .quantized_cache import KVQuant, batchable, make_cache
from .speculation.batch import Proposer, SpecBatch

__all__ = ["MLXBatch", "attach_logprobs"]

_GENERATE = importlib.import_module("mlx_lm.generate")  # the module: the package's ``generate`` is a function


class MLXBatch:
    """mlx-lm's BatchGenerator behind :class:`~engine.core.backend.CachingBackend`.

    A step runs one decode step for the generating sequences or one chunk (``prefill_step_size`` tokens) of
    prefill for the sequences being prompted, so a long prompt spans several steps and can be cancelled
    between them; rows that chunk finished join the decode batch in the same step, so a burst's prefill groups
    each get their first tokens from the next decode step. ``caches=False`` makes it a backend that cannot hand
    out caches (tests of the scheduler's fallbacks).
    """

    def __init__(
        self,
        model: Any,
        eos_token_ids: Iterable[int],
        *,
        capacity: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        stream: mx.Stream,
        caches: bool = True,
        proposer: Proposer | None = None,
        max_k: int = 4,
        stats: EngineStats | None = None,
        fixed_shapes: bool | None = None,  # verification shapes that repeat (None: on CUDA; ragged_cache.py)
        kv_quant: KVQuant | None = None,  # quantize the rows' KV caches (engine/mlx/quantized_cache.py)
    ) -> None:
        self._caches = caches
        self._quant = kv_quant
        self._model = model
        self._stream = stream
        self._prefill_step = prefill_step_size
        self._eos = frozenset(eos_token_ids)
        self._watch: dict[int, None] = {}  # uids with a checkpoint not reached yet
        self._decoded = False  # the last step decoded only, while prompts wait: the next one is theirs
        self._checkpoints: list[SequenceCache] = []
        self._stops = StopSequences([(t,) for t in sorted(self._eos)])
        # mlx-lm's generator sets the wired limit in __init__ (``maybe_set_recommended_wired_limit``) and puts
        # back the one it found in close(): out of order with several generators (engine/mlx/process.py,
        # which sets it once per process). Made unwired, it saves None and its close() restores nothing.
        with unwired(_GENERATE, "maybe_set_recommended_wired_limit", _no_wired_limit):
            self._gen = BatchGenerator(
                model,
                completion_batch_size=capacity,
                prefill_batch_size=min(prefill_batch_size, capacity),
                prefill_step_size=prefill_step_size,
                stream=stream,
            )
        # Starts prefilled together in one batch (start_many): mlx-lm's prompt batch merges and splits plain caches
        # only (a sliding window or recurrent state prefilled ragged is not each row's own: engine/mlx/fixes.py).
        self._starts_together = kv_quant is None and all(type(c) is KVCache for c in make_prompt_cache(model))
        self._spec: SpecBatch | None = None
        if proposer is not None:  # speculative decoding: the generator's decode batch is one that speculates
            self._spec = SpecBatch.make(model, self._gen.sampler, proposer, Tuner(max_k),
                                        stats if stats is not None else EngineStats(), fixed_shapes, capacity)
        # Its own batches step constrained rows' masks at once (mlx-lm's classes stay as they are).
        masked(self._gen, self._spec)

    @property
    def supports_caches(self) -> bool:
        return self._caches

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        cache: list[Any] | None = None,
        cache_tokens: list[int] | None = None,
        checkpoint: int = 0,
        images: ImageInputs | None = None,
    ) -> int:
        if images is not None:  # the worker rejects these first; a ValueError fails only this request
            raise ValueError("this model does not accept images")
        _fresh(logits_processors)
        # A segment boundary makes mlx-lm stop the prefill there, where take_checkpoints copies the cache.
        segments = [prompt[:checkpoint], prompt[checkpoint:]] if 0 < checkpoint < len(prompt) else [prompt]
        cache = self._row_cache(cache)
        (uid,) = self._gen.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=[cache],  # type: ignore[list-item]  # None: a fresh cache
            all_tokens=[list(cache_tokens or ())],  # mlx-lm appends to it
            samplers=[sampler],  # type: ignore[list-item]  # None means the shared greedy sampler
            logits_processors=[logits_processors],
            stop_sequences=[self._stops],
        )
        if len(segments) > 1:
            self._watch[uid] = None
        return int(uid)

    def start(
        self,
        prompt: list[int],
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        cache: list[Any] | None = None,
        cache_tokens: list[int] | None = None,
    ) -> Started:
        # mlx_lm.generate's prefill (generate_step): the prompt but its last token in chunks, then the last
        # token's step gives the first token's logits. So its greedy output is the single-request output.
        cache = self._row_cache(cache) or make_cache(self._model, self._quant)
        with mx.stream(self._stream):
            for i in range(0, len(prompt) - 1, self._prefill_step):
                self._model(mx.array(prompt[i:min(i + self._prefill_step, len(prompt) - 1)])[None], cache=cache)
                mx.eval([c.state for c in cache])
            logits = self._model(mx.array(prompt[-1:])[None], cache=cache)[:, -1, :]
            if logits_processors:
                _fresh(logits_processors)  # its mask starts at the prompt's end
                context = mx.array(list(cache_tokens or ()) + prompt)
                for processor in logits_processors:
                    logits = processor(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = (sampler or greedy_sampler)(logprobs)
            mx.eval(token, [c.state for c in cache])
        first = int(token.reshape(-1)[0].item())  # type: ignore[arg-type]  # an integer array
        for p in logits_processors:  # the row is inserted with its first token, which its mask has seen then
            if isinstance(p, RowMask):
                p.feed(first)
        return Started(first, "stop" if first in self._eos else None, cache, logprobs.reshape(-1))

    def start_many(self, prompts: list[list[int]], samplers: list[Callable[[Any], Any] | None]) -> list[Started]:
        # One prompt batch of mlx-lm's (the generator's own prefill: right-padded, each row's cache its own once
        # finalized), then each row's last token in one pass, its first token sampled from its own logits.
        if not self._starts_together:
            return [self.start(p, sampler, []) for p, sampler in zip(prompts, samplers)]
        rows = PromptProcessingBatch(self._model, list(range(len(prompts))), [make_cache(self._model, None)
                                     for _ in prompts], prefill_step_size=self._prefill_step)
        with mx.stream(self._stream):
            rows.prompt([p[:-1] for p in prompts])
            logits = self._model(mx.array([p[-1:] for p in prompts]), cache=rows.prompt_cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tokens = [(sampler or greedy_sampler)(logprobs[i:i + 1]) for i, sampler in enumerate(samplers)]
            caches = [rows.extract_cache(i) for i in range(len(prompts))]
            mx.eval(tokens, [c.state for cache in caches for c in cache])
        firsts = [int(t.reshape(-1)[0].item()) for t in tokens]  # type: ignore[arg-type]  # integer arrays
        return [Started(first, "stop" if first in self._eos else None, cache, logprobs[i])
                for i, (first, cache) in enumerate(zip(firsts, caches))]

    def _row_cache(self, cache: list[Any] | None) -> list[Any] | None:
        """A row's cache as the generator takes it: with quantization, one made here when none is given (mlx-lm's
        generator would make a float one), and one read back from a file made batchable."""
        if self._quant is None:
            return cache
        return make_cache(self._model, self._quant) if cache is None else batchable(cache)

    def remove(self, uids: Iterable[int]) -> None:
        uids = list(uids)
        self._unwatch(uids)
        self._gen.remove(uids)

    def take_caches(self, uids: Iterable[int]) -> dict[int, SequenceCache]:
        uids = list(uids)
        self._unwatch(uids)
        taken = self._gen.remove(uids, return_prompt_caches=True)
        out = {int(uid): SequenceCache(list(cache), list(tokens)) for uid, (cache, tokens) in taken.items()}
        mx.eval([c.state for held in out.values() for c in held.cache])  # an unevaluated slice pins the batch
        return out

    def take_checkpoints(self) -> list[SequenceCache]:
        if not self._checkpoints:
            return []
        out, self._checkpoints = self._checkpoints, []
        return out

    def kv_bytes(self) -> int:
        draft = self._spec.proposer.kv_bytes() if self._spec is not None else 0
        return int(self._gen.prompt_cache_nbytes) + draft

    def step(self) -> Sequence[GeneratedToken]:
        if self._decoded:
            self._decoded = False
            prompts, generated = self._prompts_only()
        elif self._both_due():
            self._decoded = True
            prompts, generated = self._decode_only()
        else:
            prompts, generated = self._gen.next()
        if self._prefilled():
            prompts = [*prompts, *self._join_prefilled()]
        if prompts and self._spec is not None:
            self._spec.prompted()  # the decode step being timed spans this prompt work
        if self._watch and prompts:
            self._checkpoint(prompts)
        return generated  # type: ignore[no-any-return]

    def _both_due(self) -> bool:
        """Whether mlx-lm's step would decode and then prefill. It returns the decoded tokens only after the
        prompt chunk, so rows that just joined would wait a chunk for their first token and every row a chunk
        for its next one; such a step runs as two: :meth:`_decode_only`, then :meth:`_prompts_only` (the same
        decode passes and chunks, in the same order: mlx-lm evaluates a decode step's tokens asynchronously)."""
        gen = self._gen
        rows = len(gen._generation_batch)
        return 0 < rows < gen.completion_batch_size and bool(gen._unprocessed_sequences or gen._currently_processing)

    def _prefilled(self) -> bool:
        """Whether every row being prompted has its prompt in but its last token, with room in the decode batch.
        mlx-lm moves such rows into its decode batch at its next step's start, after that step's decode: a burst's
        second prefill group would wait a decode step of the first group's rows for its first token, the third
        group two, and so on. :meth:`_join_prefilled` moves them in the step that prefilled them instead."""
        gen = self._gen
        rows = gen._currently_processing
        if not rows or len(gen._generation_batch) + len(rows) > gen.completion_batch_size:
            return False
        return all(len(segments) == 1 and len(segments[0]) == 1 for segments, *_ in rows)

    def _join_prefilled(self) -> Any:
        """The prefilled rows into the decode batch (their last prompt token's pass, which samples their first
        token, is started: the next decode step reports it), and nothing else: no decode step, no prompt joins
        (none would be prefilled in this step; the next prompt step takes them). mlx-lm's step does this with a
        prefill batch limit of 0 and its decode batch's ``next`` shadowed."""
        gen = self._gen
        limit = gen.prefill_batch_size
        gen.prefill_batch_size = 0
        try:
            return self._prompts_only()[0]
        finally:
            gen.prefill_batch_size = limit

    def _decode_only(self) -> tuple[Any, Any]:
        """One decode step and no prompt chunk: mlx-lm's step returns early once the decode batch is full; a
        limit of 0 makes it so."""
        full = self._gen.completion_batch_size
        self._gen.completion_batch_size = 0
        try:
            return self._gen.next()  # type: ignore[no-any-return]
        finally:
            self._gen.completion_batch_size = full

    def _prompts_only(self) -> tuple[Any, Any]:
        """mlx-lm's step without its decode step: prefilled rows join, the next chunk is prefilled. Its decode
        batch's ``next`` is shadowed for the call (the batch still counts its rows, so room is as usual)."""
        batch = self._gen._generation_batch
        batch.next = _no_tokens
        try:
            return self._gen.next()  # type: ignore[no-any-return]
        finally:
            del batch.next

    def _checkpoint(self, prompts: Sequence[Any]) -> None:
        # A watched sequence's first segment end is its checkpoint (its later ones are mlx-lm's own split).
        due = [r.uid for r in prompts if r.end_of_segment and not r.end_of_prompt and r.uid in self._watch]
        if not due:
            return
        self._unwatch(due)
        for cache, tokens in self._gen.extract_cache(due).values():
            self._checkpoints.append(SequenceCache(list(cache), list(tokens)))
        mx.eval([c.state for held in self._checkpoints for c in held.cache])

    def _unwatch(self, uids: Iterable[int]) -> None:
        if self._watch:
            for uid in uids:
                self._watch.pop(uid, None)

    def attach_logprobs(self, asked: list[LogprobsAsked]) -> None:
        attach_logprobs(asked)

    def close(self) -> None:
        self._gen.close()


def _no_tokens() -> list[Any]:
    return []


def _no_wired_limit() -> None:
    """``maybe_set_recommended_wired_limit`` when the process owns the limit: sets nothing, found nothing."""
    return None


def attach_logprobs(asked: list[LogprobsAsked]) -> None:
    """Each asked-for token's log-probability and its row's ``top`` alternatives, appended to its output: one
    batched top-k over the rows of a step (``asked``: output, token, the vector it was sampled from, top)."""
    vectors = mx.stack([vector.reshape(-1) for _, _, vector, _ in asked])
    chosen = mx.take_along_axis(vectors, mx.array([[token] for _, token, _, _ in asked]), axis=-1)
    k = min(max(top for *_, top in asked), vectors.shape[-1])
    top_ids: list[list[int]] = [[] for _ in asked]
    top_values: list[list[float]] = [[] for _ in asked]
    if k:
        ids = mx.argpartition(-vectors, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(vectors, ids, axis=-1).astype(mx.float32)
        mx.eval(chosen, ids, values)
        top_ids, top_values = cast(list[list[int]], ids.tolist()), cast(list[list[float]], values.tolist())
    picked = cast(list[list[float]], chosen.astype(mx.float32).tolist())
    for (out, token, _, top), lp, row_ids, row_values in zip(asked, picked, top_ids, top_values):
        pairs = sorted(((i, v) for i, v in zip(row_ids, row_values) if v > -math.inf), key=lambda p: -p[1])
        out.logprobs.append(TokenLogprob(token, float(lp[0]), tuple(pairs[:top])))


def _fresh(processors: list[Any]) -> None:
    """A row (re)enters the batch: its first input is its prompt's last token, or a token its mask consumed."""
    for p in processors:
        if isinstance(p, RowMask):
            p.fresh = True
