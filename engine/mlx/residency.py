"""A model that comes and goes (on-demand loading): its MLX thread outlives its engine, so that its arrays are
freed, and MLX's buffer cache cleared, on the thread that made them; and what MLX holds, measured there.

MLX binds streams (and the arrays made on them) to their thread. The engine's close joins its thread; a model
loaded on demand runs on a :class:`ModelThread`, which the engine's close leaves running: the worker then drops
the model on it (:func:`release`) and joins it (:meth:`ModelThread.close`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .thread import MLXThread

__all__ = ["MemoryReading", "ModelThread", "memory_now", "release"]


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """What MLX holds, in bytes: arrays alive (``mx.get_active_memory``) and freed buffers kept for reuse."""

    active: int
    cache: int


def memory_now() -> MemoryReading:
    """MLX's memory now (process-wide)."""
    return MemoryReading(int(mx.get_active_memory()), int(mx.get_cache_memory()))


def release(held: list[Any]) -> MemoryReading:
    """Drop the last references in ``held`` (the engine, the loaded model...), collect what they leave in cycles
    and clear MLX's buffer cache: run on the model's thread. What MLX holds afterwards."""
    held.clear()
    gc.collect()
    # Process-wide: the freed weights' buffers go back to the system, not to the pool; the other engines pay only
    # re-allocations (engine/mlx/process.py), once per unload.
    mx.clear_cache()
    return memory_now()


class ModelThread(MLXThread):
    """A model's MLX thread that outlives its engine: the engine's close leaves it running (for :func:`release`);
    :meth:`close` joins it."""

    async def aclose(self) -> None:
        """The engine's close: the thread stays until :meth:`close`."""

    async def close(self) -> None:
        """Finish queued calls, release the stream on its thread, and join it."""
        await super().aclose()
