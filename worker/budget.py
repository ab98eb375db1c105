"""The weight budget of on-demand loading (``MLXQ_MODEL_MEMORY``): which loaded models to unload so that another
fits, and which have sat idle too long. A pure policy: no MLX, no Redis, no clock (callers pass the time).

Weights are counted as vllm-mlx counts them: the summed size of a model's ``.safetensors`` files (and its draft
model's), not what MLX reports once loaded: known before loading, and the same on every machine. Pinned models
(``MLXQ_MODEL``, ``MLXQ_MODELS``) count against the budget and are never chosen; a model holding jobs is never
chosen either.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxq.api.errors import ConfigError

if TYPE_CHECKING:
    from .config import WorkerConfig

__all__ = ["Entry", "WeightBudget", "budget_problem", "model_weights", "weights_bytes"]

_WEIGHT_FILES = ("*.safetensors", "*.gguf")


def weights_bytes(path: str) -> int | None:
    """The summed size of the weight files of the model directory at ``path``; None when it is not a local
    directory (a hub id: its size is not known before it is downloaded)."""
    local = Path(path).expanduser()
    if not local.is_dir():
        return None
    return sum(f.stat().st_size for pattern in _WEIGHT_FILES for f in local.glob(pattern) if f.is_file())


@dataclass(slots=True)
class Entry:
    """One model in the budget."""

    name: str
    weights: int  # bytes
    pinned: bool
    loaded: bool = False
    last_used: float = 0.0  # when it last held a job (or loaded), on the caller's clock


class WeightBudget:
    """The models a worker may hold, their weights against ``limit`` bytes (None: no bound), least recently used
    first out."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.entries: dict[str, Entry] = {}

    def add(self, name: str, weights: int, *, pinned: bool) -> None:
        """A model this worker serves (not loaded yet)."""
        self.entries[name] = Entry(name, weights, pinned)

    def loaded(self, name: str, now: float) -> None:
        """``name`` is in memory now."""
        entry = self.entries[name]
        entry.loaded, entry.last_used = True, now

    def unloaded(self, name: str) -> None:
        """``name`` left memory."""
        self.entries[name].loaded = False

    def used(self, name: str, now: float) -> None:
        """``name`` held a job at ``now``."""
        self.entries[name].last_used = now

    @property
    def in_use(self) -> int:
        """Bytes of weights loaded now."""
        return sum(e.weights for e in self.entries.values() if e.loaded)

    def victims(self, name: str, busy: Collection[str]) -> list[str] | None:
        """The loaded models to unload, least recently used first, so that ``name`` fits: none when it fits as is;
        None when it cannot fit now (the rest are pinned or hold jobs, in ``busy``)."""
        need = self.entries[name].weights
        if self.limit is None or self.in_use + need <= self.limit:
            return []
        free, chosen = self.limit - self.in_use, []
        for entry in self._idle_first(busy):
            chosen.append(entry.name)
            free += entry.weights
            if free >= need:
                return chosen
        return None

    def idle(self, now: float, idle_s: float, busy: Collection[str]) -> list[str]:
        """Loaded, unpinned models without jobs whose last use is more than ``idle_s`` ago (0: none ever)."""
        if idle_s <= 0:
            return []
        return [e.name for e in self._idle_first(busy) if now - e.last_used > idle_s]

    def _idle_first(self, busy: Collection[str]) -> Iterable[Entry]:
        candidates = [e for e in self.entries.values() if e.loaded and not e.pinned and e.name not in busy]
        return sorted(candidates, key=lambda e: e.last_used)


def budget_problem(limit: int | None, pinned: dict[str, int], loadable: dict[str, int]) -> str | None:
    """Why ``limit`` cannot serve these models (weights by name), or None: the pinned models must fit with the
    smallest loadable one beside them."""
    if limit is None or not loadable:
        return None
    smallest = min(loadable, key=lambda name: loadable[name])
    need = sum(pinned.values()) + loadable[smallest]
    if need <= limit:
        return None
    held = f" beside the pinned models' {_gib(sum(pinned.values()))}" if pinned else ""
    return (f"MLXQ_MODEL_MEMORY={_gib(limit)} is too small: the smallest loadable model, {smallest}, needs "
            f"{_gib(loadable[smallest])}{held}")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}GiB" if n >= 1 << 26 else f"{n}B"


def model_weights(config: WorkerConfig) -> dict[str, int]:
    """Each served model's weight bytes (its and its draft's safetensors files: worker/budget.py), by name;
    ConfigError when ``MLXQ_MODEL_MEMORY`` cannot hold the pinned models and the smallest loadable one, or cannot
    count a model's weights (a hub id)."""
    sizes: dict[str, int] = {}
    for served in config.served:
        counted = [weights_bytes(path) for path in (served.path, served.draft) if path]
        if config.model_memory is not None and None in counted:
            raise ConfigError(f"MLXQ_MODEL_MEMORY counts the weight files of local model directories: give "
                              f"{served.name} as a local path (hf download it first)")
        sizes[served.name] = sum(n or 0 for n in counted)
    pinned = {m.name: sizes[m.name] for m in config.served if not m.loadable}
    loadable = {m.name: sizes[m.name] for m in config.served if m.loadable}
    problem = budget_problem(config.model_memory, pinned, loadable)
    if problem is not None:
        raise ConfigError(problem)
    return sizes
