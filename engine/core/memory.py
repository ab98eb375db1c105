"""KV-cache memory: what a model's caches allocate, how much a batch may hold, and the default headroom.

mlx-lm's cache buffers grow 256 tokens at a time and ``BatchKVCache`` left-pads every row to the longest, so a
batch of ``n`` rows whose longest reaches ``L`` tokens holds at most ``n x (L + 255)`` tokens' worth.
:class:`KVBudget` charges exactly that, for the longest each admitted sequence may get (prompt + max_tokens),
so the caches stay under the headroom while it runs.

The default headroom (``default_headroom``): 75 % of the memory MLX may use on its device, minus the weights
and the prefix cache's bound (the rest covers a prompt batch's copy into the decode batch); never less than
one full-context sequence.

What a model's caches and the device measure is ``engine/mlx/memory.py`` (MLX); this module imports no MLX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["KV_STEP", "DeviceMemory", "KVBudget", "KVLayout", "default_headroom", "default_prefix_cache_bytes", "mib"]

log = logging.getLogger(__name__)

KV_STEP = 256  # tokens a KVCache grows by (mlx_lm KVCache.step)
_HEADROOM_SHARE = 0.75  # of usable memory: the rest is activations, copies inside a step, Python
_PREFIX_SHARE = 10  # the default prefix cache bound: a tenth of usable memory...
_PREFIX_MAX = 4 << 30  # ...and at most 4 GiB


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one sequence's caches allocate: ``bytes_per_token`` over the layers whose KV grows with the
    sequence (keys and values), in buffers that grow ``step`` tokens at a time; ``fixed_bytes`` of state that
    does not grow (recurrent layers: mlx-lm's ``ArraysCache``); and ``windows``, sliding-window layers
    (``RotatingKVCache``) as (bytes per token, the most tokens their buffer holds: the window plus a prefill
    chunk, which such a cache keeps whole until the next step)."""

    bytes_per_token: int
    step: int = KV_STEP
    fixed_bytes: int = 0
    windows: tuple[tuple[int, int], ...] = ()

    def row_bytes(self, tokens: int) -> int:
        """The most one batch row may allocate while it grows to ``tokens`` tokens: its buffers run up to a
        step, less one token, past their contents."""
        return self.cache_bytes(max(tokens, 1) + self.step - 1)

    def cache_bytes(self, tokens: int) -> int:
        """What one sequence's cache of ``tokens`` tokens holds once copied out of a batch (exact lengths)."""
        return (self.fixed_bytes + tokens * self.bytes_per_token
                + sum(min(tokens, cap) * b for b, cap in self.windows))

    @property
    def per_token_bytes(self) -> int:
        """What one more token costs while every layer still grows (for messages)."""
        return self.bytes_per_token + sum(b for b, _ in self.windows)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The KV bytes a batch may fill (``headroom``) and how to charge sequences against it."""

    headroom: int
    layout: KVLayout

    def batch_bytes(self, rows: int, longest: int) -> int:
        """What ``rows`` sequences in one batch hold once the longest has ``longest`` tokens (every row is
        padded to it)."""
        return rows * self.layout.row_bytes(longest) if rows > 0 else 0

    def rows_that_fit(self, longest: int, beside: int) -> int:
        """How many rows of a batch whose longest sequence reaches ``longest`` fit beside ``beside`` bytes (parked
        caches, say)."""
        return max(0, (self.headroom - beside) // self.layout.row_bytes(longest))


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device MLX runs a model on, and the bytes it may allocate there."""

    backend: str  # "metal", "cuda" or "cpu"
    name: str
    usable: int

    def describe(self) -> str:
        return f"{self.name} ({self.backend}, {mib(self.usable)} usable)"


def default_prefix_cache_bytes(usable: int) -> int:
    """The prefix cache's default bound: a tenth of usable memory, at most 4 GiB."""
    return min(_PREFIX_MAX, usable // _PREFIX_SHARE)


def default_headroom(usable: int, weights: int, prefix_cache: int, layout: KVLayout, context: int | None) -> int:
    """75 % of ``usable`` minus the weights and the prefix cache's bound; at least one full-context row."""
    floor = layout.row_bytes(context or 4096)
    headroom = int(usable * _HEADROOM_SHARE) - weights - prefix_cache
    if headroom < floor:
        log.warning("KV headroom %s by the default rule (75%% of %s usable - %s weights - %s prefix cache) is less "
                    "than one %d-token sequence; using %s: this machine may run out of memory",
                    mib(headroom), mib(usable), mib(weights), mib(prefix_cache), context or 4096, mib(floor))
        return floor
    return headroom


def mib(n: int) -> str:
    """Bytes as MiB, for messages."""
    return f"{n / (1 << 20):.1f} MiB"
