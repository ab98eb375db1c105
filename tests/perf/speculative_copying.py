"""Prompt lookup where the answer copies the prompt, for ``python3 -m tests.perf.speculative``: a target whose every
token has a fixed successor (at the target's cost per step), and prompts that hold the text the answer will be."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from mlxq.worker.tools.bench.runs import say

if TYPE_CHECKING:
    from tests.perf.speculative import Bench

__all__ = ["copy_task", "copying_model", "copying_prompts"]


def copying_model() -> tuple[Any, list[int]]:
    """small-target with its layers' output projections zeroed: each position's logits then depend on its own
    token only (next = f(token)), at the target's cost per step; and ``f`` over the vocabulary."""
    import mlx.core as mx
    import mlx_lm

    from mlxq.worker.tools.tinymodel import ensure_model

    model = mlx_lm.load(str(ensure_model("small-target")))[0]
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight = mx.zeros_like(proj.weight)
    vocab = model.model.embed_tokens.weight.shape[0]
    follow = mx.argmax(model(mx.arange(vocab)[None]), axis=-1)[0].tolist()
    return model, cast(list[int], follow)


def copying_prompts(follow: list[int], n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Each prompt holds the text its answer will be: a chain of ``f`` of ``max_tokens + 32`` tokens, then its
    first 32 again, so the answer goes on as the chain did (as an answer quotes a passage it was given)."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        chain = [rng.randrange(len(follow))]
        while len(chain) < max_tokens + 32:
            chain.append(follow[chain[-1]])
        prompts.append(chain + chain[:32])
    return prompts


def copy_task(bench: Bench, sizes: Sequence[int], repeats: int) -> dict[int, tuple[float, float, float]]:
    """Prompt lookup against plain decoding where the answer copies the prompt: tok/s each, and proposals taken."""
    model, follow = copying_model()
    out = {}
    for n in sizes:
        prompts = copying_prompts(follow, n, bench.max_tokens, seed=n)
        batches = [bench.batch(kind, n, model) for kind in (None, "ngram")]
        best = [0.0, 0.0]
        for _ in range(repeats + 1):  # the first round warms up
            for i, batch in enumerate(batches):
                best[i] = max(best[i], bench.burst(batch, prompts)[0])
        spec = batches[1]._spec
        assert spec is not None
        stats = spec.stats
        out[n] = (best[0], best[1], stats.spec_accepted / max(1, stats.spec_drafted))
        say(f"copying N={n}: plain {best[0]:.1f} tok/s, prompt lookup {best[1]:.1f} ({best[1] / best[0]:.2f}x), "
            f"{out[n][2]:.2f} of proposals taken")
    return out
