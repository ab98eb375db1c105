"""The KV layout of models whose caches do not all grow with the sequence: a hybrid model's recurrent state
(mlx-lm's ``ArraysCache``) is charged once per sequence, a sliding-window layer's buffer (``RotatingKVCache``)
no further than its window and a prefill chunk. Real mlx-lm model classes, random weights, built in memory."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import gemma3_text, lfm2
from mlx_lm.models.cache import make_prompt_cache

from mlxq.engine.core.memory import KV_STEP, KVBudget
from mlxq.engine.mlx.memory import measure_layout

pytestmark = pytest.mark.unit

PREFILL = 64


def _hybrid() -> Any:
    # LFM2: short-convolution layers (fixed state) with two attention layers (growing KV) among them.
    args = lfm2.ModelArgs(model_type="lfm2", vocab_size=128, hidden_size=64, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
                          conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
                          block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
                          full_attn_idxs=[2, 5])
    return _materialized(lfm2.Model(args))


def _windowed() -> Any:
    # Gemma 3: five sliding-window layers (a 96-token window) for each global one.
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                                 num_attention_heads=4, head_dim=16, vocab_size=128, num_key_value_heads=2,
                                 query_pre_attn_scalar=16, sliding_window=96, sliding_window_pattern=6)
    return _materialized(gemma3_text.Model(args))


def _materialized(model: Any) -> Any:
    mx.eval(model.parameters())
    return model


def _cache_bytes_after(model: Any, tokens: int) -> int:
    """What one sequence's caches allocate after a prefill of ``tokens`` in ``PREFILL``-token chunks, as mlx-lm's
    batch prefills, then one decode step."""
    cache = make_prompt_cache(model)
    for i in range(0, tokens, PREFILL):
        model(mx.array([[1] * min(PREFILL, tokens - i)]), cache=cache)
    model(mx.array([[2]]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(int(c.nbytes) for c in cache)


@pytest.mark.parametrize("build", [_hybrid, _windowed], ids=["hybrid", "sliding-window"])
def test_a_sequence_never_allocates_more_than_its_row_is_charged_and_not_much_less(build: Any) -> None:
    model = build()
    layout = measure_layout(model, PREFILL)
    for tokens in (1, 40, 200, 700, 1500):
        actual = _cache_bytes_after(model, tokens)
        charged = layout.row_bytes(tokens + 1)
        assert actual <= charged, (tokens, actual, charged)
        # At most one step of each cache's buffer unused: fixed state and windows are not charged per token.
        assert charged - actual < KV_STEP * layout.per_token_bytes, (tokens, actual, charged)


def test_a_hybrid_models_fixed_state_is_charged_once_per_sequence() -> None:
    layout = measure_layout(_hybrid(), PREFILL)
    assert layout.fixed_bytes > 0 and layout.bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 attention layers, K+V, fp32
    assert not layout.windows
    assert layout.row_bytes(4000) - layout.row_bytes(1000) == 3000 * layout.bytes_per_token


def test_a_sliding_window_layer_stops_growing_at_its_window_and_a_prefill_chunk() -> None:
    layout = measure_layout(_windowed(), PREFILL)
    ((per_token, cap),) = layout.windows
    assert cap == 96 + PREFILL - 1 and per_token == 5 * 2 * 2 * 16 * 4  # five windowed layers
    assert layout.row_bytes(4000) - layout.row_bytes(1000) == 3000 * layout.bytes_per_token
    assert layout.cache_bytes(1000) == 1000 * layout.bytes_per_token + cap * per_token


def test_a_real_batch_of_a_hybrid_model_stays_within_what_its_rows_are_charged() -> None:
    model = _hybrid()
    layout = measure_layout(model, PREFILL)
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4, prefill_step_size=PREFILL)
    lengths = [5, 120, 300]
    gen.insert([[3] * n for n in lengths], max_tokens=[20, 20, 20])
    budget = KVBudget(1 << 40, layout)
    seen = 0
    for _ in range(40):  # five prefill chunks and 20 decode steps, then nothing left
        gen.next()
        seen = max(seen, gen.prompt_cache_nbytes)
        assert gen.prompt_cache_nbytes <= budget.batch_bytes(len(lengths), max(lengths) + 20)
    assert seen > 0
    gen.close()
