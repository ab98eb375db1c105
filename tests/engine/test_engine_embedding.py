"""The embedding model's forward pass (engine/mlx/embedding.py) on the generated tiny Qwen3-Embedding model: rows
of different lengths in one right-padded pass pool exactly what each computed alone gives (mlx-lm's
``model.model``, last token, normalised); ``dimensions`` cut and normalise again; the loader tells an embedding
model by its files, and MLXQ_MODEL_KIND overrides it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxq.engine.core.embedding import Row
from mlxq.engine.mlx.embedding import EmbeddingBatch, is_embedding_model
from mlxq.engine.mlx.loader import load_model
from mlxq.worker.tools.tinymodel import ENDOFTEXT

pytestmark = pytest.mark.unit

TEXTS = ["hello", "a much longer sentence about the queue and its model", "the server", "x y"]


@pytest.fixture(scope="module")
def loaded(tiny_embed_model: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(tiny_embed_model))
    return model, tokenizer


def alone(model: Any, tokens: list[int], dimensions: int | None = None) -> np.ndarray:
    """The reference: the row run by itself through mlx-lm's inner model, its last token, normalised."""
    state = np.asarray(model.model(mx.array([tokens]))[0, -1].astype(mx.float32))
    state = state[:dimensions] if dimensions else state
    return state / np.linalg.norm(state)


def test_the_tokenizer_appends_endoftext_the_pooled_token(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    for text in TEXTS:
        assert tokenizer.encode(text)[-1] == tokenizer.convert_tokens_to_ids(ENDOFTEXT)


def test_rows_of_different_lengths_in_one_pass_equal_each_row_alone(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    rows = [Row("r", i, tokenizer.encode(t), None) for i, t in enumerate(TEXTS)]
    rows.append(Row("ids", 0, [5, 6, 7], None))  # token ids pooled as given (no token appended)
    assert len({len(r.tokens) for r in rows}) > 2  # padding takes part
    vectors = EmbeddingBatch(model).embed(rows)
    for row, got in zip(rows, vectors, strict=True):
        v = np.frombuffer(got, "<f4")
        assert v.shape == (64,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5
        assert float(v @ alone(model, row.tokens)) >= 0.99999


def test_dimensions_cut_the_vector_and_normalise_it_again(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    tokens = tokenizer.encode(TEXTS[1])
    full, cut = EmbeddingBatch(model).embed([Row("a", 0, tokens, None), Row("b", 0, tokens, 16)])
    v, w = np.frombuffer(full, "<f4"), np.frombuffer(cut, "<f4")
    assert w.shape == (16,) and abs(float(np.linalg.norm(w)) - 1) < 1e-5
    assert float(w @ alone(model, tokens, 16)) >= 0.99999
    assert np.allclose(w, v[:16] / np.linalg.norm(v[:16]), atol=1e-6)


def test_the_loader_tells_an_embedding_model_by_its_files_and_the_kind_overrides(
        tiny_embed_model: Path, tiny_model: Path) -> None:
    assert is_embedding_model(str(tiny_embed_model)) and not is_embedding_model(str(tiny_model))
    assert load_model(str(tiny_embed_model)).embedding_width == 64
    assert load_model(str(tiny_embed_model), "chat").embedding_width is None
    assert load_model(str(tiny_model)).embedding_width is None
    assert load_model(str(tiny_model), "embedding").embedding_width == 64


def test_a_checkpoint_without_the_inner_models_prefix_loads_as_an_embedding_model(
        tiny_embed_model: Path, tmp_path: Path, loaded: tuple[Any, Any]) -> None:
    # Hugging Face's Qwen3-Embedding stores its weights without "model." (mlx-lm alone refuses such a checkpoint).
    bare = tmp_path / "bare"
    shutil.copytree(tiny_embed_model, bare)
    weights = mx.load(str(bare / "model.safetensors"))
    mx.save_safetensors(str(bare / "model.safetensors"), {k.removeprefix("model."): v for k, v in weights.items()})
    with pytest.raises(ValueError, match="parameters not in model"):
        mlx_lm.load(str(bare))
    model, tokenizer = loaded
    served = load_model(str(bare))
    assert served.embedding_width == 64
    tokens = tokenizer.encode(TEXTS[1])
    (got,) = EmbeddingBatch(served.model).embed([Row("r", 0, tokens, None)])
    assert float(np.frombuffer(got, "<f4") @ alone(model, tokens)) >= 0.99999
