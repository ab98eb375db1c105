"""mlx-lm's generation batch with its constrained rows masked at once (an MLX adapter).

:class:`MaskedGenerationBatch` is mlx-lm's ``GenerationBatch`` whose step, when a row is constrained (its logits
processors hold a :class:`~engine.mlx.constrain.RowMask`), fills the batch's masks while MLX computes the logits and
applies them to every row in one operation. :class:`MaskedPromptBatch` is mlx-lm's prompt batch that hands its
prefilled rows on as such a batch (their first token is sampled there). An ``MLXBatch`` puts both into its own
``BatchGenerator``: mlx-lm's classes are left as they are for every other user of the process.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from .constrain import RowMask, apply_bitmask, fill_masks

__all__ = ["MaskedGenerationBatch", "MaskedPromptBatch", "masked"]


class MaskedGenerationBatch(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's generation batch, its constrained rows masked in one operation per step."""

    def _step(self) -> Any:
        """mlx-lm's ``GenerationBatch._step``, unchanged unless a row is constrained: then :func:`_masked_step`."""
        procs = self.logits_processors
        if not procs or not any(isinstance(p, RowMask) for ps in procs if ps for p in ps):
            return super()._step()
        return _masked_step(self)


class MaskedPromptBatch(PromptProcessingBatch):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's prompt batch whose prefilled rows go on as a :class:`MaskedGenerationBatch` (mlx-lm's
    ``split`` copies a batch as its own class, so the rows split off for generation are one too)."""

    def generate(self, tokens: list[list[int]]) -> MaskedGenerationBatch:
        """mlx-lm's ``PromptProcessingBatch.generate``, making the masked batch (whose first step samples the
        rows' first tokens)."""
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        generation = MaskedGenerationBatch(
            self.model,
            self.uids,
            mx.array([t[-1] for t in tokens]),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
        )
        self.uids = []
        self.prompt_cache = []
        self.tokens = []
        self.samplers = []
        self.logits_processors = []
        self.max_tokens = []
        return generation


def masked(gen: Any, generation: GenerationBatch | None = None) -> None:
    """Make a fresh mlx-lm ``BatchGenerator`` prefill into a :class:`MaskedPromptBatch` and decode in
    ``generation`` (by default a :class:`MaskedGenerationBatch` of its own)."""
    assert not gen._prompt_batch.uids and not gen._generation_batch.uids, "only a fresh generator"
    gen._prompt_batch = MaskedPromptBatch.empty(gen.model, gen.sampler, prefill_step_size=gen.prefill_step_size)
    if generation is None:  # (not ``or``: an empty batch has no rows, so it is falsy)
        generation = MaskedGenerationBatch.empty(gen.model, gen.sampler)
    gen._generation_batch = generation


def _masked_step(batch: Any) -> Any:
    """mlx-lm's ``GenerationBatch._step`` for a batch with a constrained row: the batch's masks are filled while
    MLX computes the logits and applied to every row in one operation, and only the rows' other processors run
    one row at a time (as mlx-lm runs them)."""
    procs = batch.logits_processors
    batch._current_tokens = batch._next_tokens
    batch._current_logprobs = batch._next_logprobs
    inputs = batch._current_tokens
    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    mx.async_eval(logits)  # the forward pass runs while the matchers advance and fill their masks
    fed = inputs.tolist()
    masks = [(e, p) for e, ps in enumerate(procs) for p in ps or () if isinstance(p, RowMask)]
    logits = apply_bitmask(logits, fill_masks(masks, fed, len(batch.uids), logits.shape[-1]))
    token_context = []
    others = [[p for p in ps or () if not isinstance(p, RowMask)] for ps in procs]
    if any(others):
        rows = []
        for e, processors in enumerate(others):
            row = logits[e : e + 1]
            if processors:
                context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    row = processor(context, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s for s in (batch.samplers or [None] * len(batch.uids))]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    batch._next_tokens = sampled
    batch._next_logprobs = list(logprobs)
    mx.async_eval(batch._next_tokens, batch._next_logprobs, token_context)
    mx.eval(inputs, batch._current_logprobs)
    for sti, ti in zip(batch.tokens, fed):
        sti.append(ti)
    return fed, batch._current_logprobs
