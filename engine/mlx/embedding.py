"""An embedding model's forward pass (Qwen3-Embedding's kind: a decoder loaded by mlx-lm, last-token pooling).

``model.model(tokens)`` (mlx-lm's inner model, the one under the language-model head) returns the final normed
hidden states. A pass takes rows of different lengths at once: sorted by length and padded on the right, with
the causal mask mlx-lm applies when no cache is given, so each row's last real token sees exactly its own tokens,
as if run alone (padding after it cannot reach it). That token's state is pooled, L2-normalised, cut to the row's
``dimensions`` and normalised again (Matryoshka truncation).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..core.embedding import Row

__all__ = ["EmbeddingBatch", "embedding_width", "is_embedding_model", "load_unprefixed", "pool_last"]

log = logging.getLogger(__name__)

_PAD = 0  # what pads a row: never seen by a real token (the mask is causal, the padding comes after)


class EmbeddingBatch:
    """Runs rows through ``model.model`` on the model's MLX stream, one forward pass per call."""

    def __init__(self, model: Any, stream: mx.Stream | None = None) -> None:
        self.model = model
        self.stream = stream

    def embed(self, rows: Sequence[Row]) -> list[bytes]:
        """Each row's normalised last-token vector (cut to its ``dimensions``), as little-endian float32 bytes."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens))  # alike lengths side by side
        longest = len(rows[order[-1]].tokens)
        tokens = np.full((len(rows), longest), _PAD, dtype=np.int32)
        for place, i in enumerate(order):
            tokens[place, :len(rows[i].tokens)] = rows[i].tokens
        lengths = mx.array([len(rows[i].tokens) for i in order])
        pooled = pool_last(self.model.model(mx.array(tokens)), lengths)
        vectors = np.asarray(pooled.astype(mx.float32))
        out: list[bytes] = [b""] * len(rows)
        for place, i in enumerate(order):
            out[i] = _normalised(vectors[place], rows[i].dimensions)
        return out

    def close(self) -> None:
        """Nothing to release: a pass keeps no state."""


def pool_last(hidden: mx.array, lengths: mx.array) -> mx.array:
    """Each row's hidden state at its last real token (``lengths``: each row's tokens, the rest padding)."""
    index = (lengths - 1).reshape(-1, 1, 1)
    return mx.take_along_axis(hidden, index, axis=1).squeeze(1)


def _normalised(vector: np.ndarray, dimensions: int | None) -> bytes:
    cut = vector[:dimensions] if dimensions is not None else vector
    norm = float(np.linalg.norm(cut))
    return (cut / norm if norm > 0 else cut).astype("<f4").tobytes()


def is_embedding_model(path: str) -> bool:
    """Whether a local checkpoint is an embedding model of the kind served here: sentence-transformers' modules
    with a pooling module that pools the last token (``1_Pooling/config.json``: ``pooling_mode_lasttoken``)."""
    root = Path(path)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return False
    pooling = [m.get("path") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")]
    for where in pooling:
        try:
            config = json.loads((root / str(where) / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("pooling_mode_lasttoken"):
            return True
    if pooling:
        log.warning("%s has a sentence-transformers pooling module that does not pool the last token: served as a "
                    "chat model (MLXQ_MODEL_KIND=embedding serves it with last-token pooling)", path)
    return False


def embedding_width(model: Any) -> int:
    """The width of its vectors: its hidden size."""
    args = getattr(model, "args", None)
    width = getattr(args, "hidden_size", None)
    if width is None:
        width = model.model.embed_tokens.weight.shape[-1]
    return int(width)


def load_unprefixed(path: str) -> tuple[Any, Any, dict[str, Any]]:
    """mlx-lm's model, tokenizer and config of a local checkpoint whose weights lack the ``model.`` prefix of the
    inner model's (as Hugging Face's Qwen3-Embedding is stored, the language-model head left out): each such
    weight is read as the inner model's. Other weights load as mlx-lm loads them."""
    from mlx_lm.utils import load_model, load_tokenizer

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")

        class Prefixed(arch.Model):  # type: ignore[name-defined,misc]
            def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
                named = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in weights.items()}
                return dict(super().sanitize(named))

        return Prefixed, arch.ModelArgs

    model, config = load_model(Path(path), get_model_classes=classes)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    log.info("%s: its weights lack the inner model's prefix (model.): read as the inner model's", path)
    return model, tokenizer, config
