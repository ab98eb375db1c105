"""What MLX measures for the KV budget (an MLX adapter): a model's cache layout and weights, and the memory of the
device it runs on. The budget itself is ``engine/core/memory.py``, which imports no MLX."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

from ..core.memory import KV_STEP, DeviceMemory, KVLayout
from .quantized_cache import KVQuant, make_cache

__all__ = ["device_memory", "measure_layout", "model_bytes", "usable_memory_bytes"]


def measure_layout(model: Any, prefill_step: int = 2048, quant: KVQuant | None = None) -> KVLayout:
    """Run one token through a fresh prompt cache of ``model`` and read what each layer's buffers allocated
    (on the model's MLX thread): growing KV, fixed recurrent state and sliding windows apart, so a hybrid
    model's fixed state is not charged as if it grew with every token. A cache of a kind not known here is
    charged as growing: an overestimate, never an under-one. ``prefill_step``: the batch's prefill chunk;
    ``quant``: the caches are quantized (their packed values, scales and biases are what is measured)."""
    cache = make_cache(model, quant)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    growing = fixed = 0
    windows: dict[int, int] = {}
    for c in _leaves(cache):
        n = int(c.nbytes)
        if isinstance(c, ArraysCache):
            fixed += n
        elif isinstance(c, RotatingKVCache):
            cap = int(c.max_size) + prefill_step - 1
            windows[cap] = windows.get(cap, 0) + -(-n // max(1, min(int(c.step), int(c.max_size))))
        else:
            growing += -(-n // int(getattr(c, "step", KV_STEP)))
    return KVLayout(max(1, growing) if not (fixed or windows) else growing, KV_STEP, fixed,
                    tuple(sorted((b, cap) for cap, b in windows.items())))


def _leaves(caches: list[Any]) -> list[Any]:
    """The caches of ``caches``, with mlx-lm's ``CacheList`` (several caches for one layer) opened."""
    out: list[Any] = []
    for c in caches:
        out.extend(_leaves(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


def model_bytes(model: Any) -> int:
    """Bytes of the model's parameters."""
    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(int(p.nbytes) for _, p in params)


def device_memory(info: dict[str, Any] | None = None, device: Any = None) -> DeviceMemory:
    """Where MLX runs and what it may allocate: Metal's recommended working set on a Mac; on MLX's CUDA backend,
    the GPU's memory (``mx.device_info()``'s ``total_memory``); on the CPU, the smaller of RAM and MLX's limit.
    ``info`` and ``device``: what ``mx.device_info()`` and ``mx.default_device()`` say (by default, ask them)."""
    info = mx.device_info() if info is None else info
    device = mx.default_device() if device is None else device
    name = str(info.get("device_name") or info.get("architecture") or device)
    ws = info.get("max_recommended_working_set_size")
    if ws:
        return DeviceMemory("metal", name, int(ws))
    total = info.get("total_memory")
    if total and device.type == mx.DeviceType.gpu:
        return DeviceMemory("cuda", name, int(total))
    ram = int(info.get("memory_size") or 0) or _physical_memory()
    limit = int(mx.get_memory_limit())
    return DeviceMemory("cpu", name, min(v for v in (ram, limit, 1 << 62) if v > 0))


def usable_memory_bytes() -> int:
    """What MLX may allocate on the device it runs on (:func:`device_memory`)."""
    return device_memory().usable


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
