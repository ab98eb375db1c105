"""MLX's process-global state and its one owner: the wired limit, the memory and cache limits.

mlx-lm's and mlx-vlm's ``BatchGenerator`` set the wired limit when made and restore the one they found when
closed; with several engines in a process the restores come out of order. So :func:`mlx_process` sets the
limits once per process, and the generators are made inside :func:`unwired`, their set/restore a no-op.
``mx.clear_cache``, which both libraries call as they step, is process-global too: it costs the other engines
re-allocations, not correctness, so a cache limit (:attr:`MLXLimits.cache_bytes`) bounds the shared pool.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx

__all__ = ["MLXLimits", "MLXProcess", "mlx_process", "unwired"]

log = logging.getLogger(__name__)

_owner_lock = threading.Lock()
_patch_lock = threading.Lock()  # one unwired() block at a time
_owner: MLXProcess | None = None


@dataclass(frozen=True, slots=True)
class MLXLimits:
    """Optional process-wide limits (None: MLX's default)."""

    memory_bytes: int | None = None  # mx.set_memory_limit: what MLX may allocate before it waits or fails
    cache_bytes: int | None = None  # mx.set_cache_limit: freed buffers MLX keeps for reuse


class MLXProcess:
    """The process's MLX-global state, set when made: the wired limit (Metal's recommended working set, when
    the device reports one; the CPU has none) and :class:`MLXLimits`. Make it through :func:`mlx_process`."""

    def __init__(self, limits: MLXLimits) -> None:
        self.limits = limits
        recommended = mx.device_info().get("max_recommended_working_set_size")
        self.wired_bytes = int(recommended) if recommended else None
        if self.wired_bytes is not None:
            mx.set_wired_limit(self.wired_bytes)
        if limits.memory_bytes is not None:
            mx.set_memory_limit(limits.memory_bytes)
        if limits.cache_bytes is not None:
            mx.set_cache_limit(limits.cache_bytes)
        log.info("MLX process limits: wired %s, memory %s, cache %s", self.wired_bytes or "-",
                 limits.memory_bytes or "default", limits.cache_bytes if limits.cache_bytes is not None else "default")


def mlx_process(limits: MLXLimits | None = None) -> MLXProcess:
    """The process's :class:`MLXProcess`, made (and its limits set) on the first call. Later calls return the
    same one: limits that differ from the first call's are ignored with a warning (they are process-wide)."""
    global _owner
    with _owner_lock:
        if _owner is None:
            _owner = MLXProcess(limits or MLXLimits())
        elif limits is not None and limits != _owner.limits:
            log.warning("MLX limits %s ignored: this process already runs with %s", limits, _owner.limits)
        return _owner


@contextlib.contextmanager
def unwired(module: ModuleType, name: str, stand_in: object) -> Iterator[None]:
    """While the block runs, ``module.name`` (a library's wired-limit setter) is ``stand_in`` (a no-op), so
    a generator made in the block neither sets the wired limit nor restores one when closed. Blocks run one
    at a time (engines make their batches on their own threads)."""
    with _patch_lock:
        original = getattr(module, name)
        setattr(module, name, stand_in)
        try:
            yield
        finally:
            setattr(module, name, original)
