"""Where the prefix cache's tier on disk keeps one model's entries: a directory under a root (``default_dir``)
named by the model's weights (:func:`model_key`) and its KV layout (:func:`layout_key`), so entries are only ever
read by the model, and in the layout, that wrote them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..quantized_cache import KVQuant, make_cache
from .entry_file import FORMAT

__all__ = ["default_dir", "layout_key", "model_key", "namespace"]


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/mlxq/kv`` (``~/.cache/mlxq/kv`` when unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxq" / "kv"


def model_key(path: str) -> str | None:
    """A digest of a model's weights as files: config.json's bytes and every other file's name, size and mtime
    (a changed or re-downloaded model gets another key). None when ``path`` is not a local directory."""
    local = Path(path).expanduser()
    if not local.is_dir():
        try:  # a hub id: its snapshot in the local Hugging Face cache
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path, local_files_only=True))
        except Exception:
            return None
    h = hashlib.sha256(f"mlxq-kv-{FORMAT}".encode())
    try:
        h.update((local / "config.json").read_bytes())
        for f in sorted(p for p in local.iterdir() if p.is_file()):
            st = f.stat()  # follows the hub cache's symlinks to the blobs
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return h.hexdigest()


def layout_key(model: Any, quant: KVQuant | None = None) -> str:
    """A digest of what the model's KV caches hold (on its MLX thread): each layer's cache class and its
    arrays' dtypes and shapes after one token (so KV quantization, ``quant``, or another dtype gets another key)."""
    cache = make_cache(model, quant)
    model(mx.array([[0]]), cache=cache)
    states = [c.state for c in cache]
    mx.eval(states)
    desc = [type(c).__name__ for c in cache]
    flat: list[tuple[str, Any]] = tree_flatten(states)  # type: ignore[assignment]
    for name, v in flat:
        desc.append(f"{name}:{v.dtype}:{v.shape}" if isinstance(v, mx.array) else f"{name}:{v!r}")
    return hashlib.sha256("\n".join(desc).encode()).hexdigest()


def namespace(root: Path, model: str, layout: str) -> Path:
    """The directory of one model's entries under ``root``."""
    return root / f"{model[:20]}-{layout[:12]}"
