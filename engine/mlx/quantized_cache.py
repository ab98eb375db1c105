"""KV cache quantization inside the continuous batch (an MLX adapter over mlx-lm's caches).

mlx-lm quantizes one sequence's cache (``QuantizedKVCache``) but its ``BatchGenerator`` cannot: that class has no
``merge``/``extract``/``filter``/``extend`` (ml-explore/mlx-lm#1583). :class:`BatchQuantizedKVCache` is mlx-lm's
``BatchKVCache`` holding each of keys and values as ``mx.quantize``'s triple (packed uint32, scales, biases), after
mlx-vlm's ``BatchQuantizedKVCache`` (mlx-vlm is an optional extra here, so it is not imported); a row taken out
of it is a :class:`QuantizedRowCache`, mlx-lm's ``QuantizedKVCache`` that can join a batch again. Attention goes
through mlx-lm's ``quantized_scaled_dot_product_attention``: its ``scaled_dot_product_attention`` dispatches on
the cache having ``bits``.

Nothing of mlx-lm is patched: an engine with quantization on makes every row's cache itself (:func:`make_cache`)
and hands it to the generator. Only plain ``KVCache`` layers are quantized; sliding windows (``RotatingKVCache``,
whose batch form has no quantized variant in mlx-lm) and recurrent state (``ArraysCache``) stay as they are
(:func:`unquantized`).

Keys and values are quantized as they are written, from a row's first token: a prompt's own tokens attend to each
other through the quantized cache, however it is chunked or resumed from a cached prefix. (mlx-lm's
``generate_step`` with ``kv_bits`` keeps its first prefill chunk in float and quantizes after it; the engine matches
mlx-lm's single-request decoding through a ``QuantizedKVCache`` made before the prompt.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

from .ragged_cache import RaggedKVCache

__all__ = ["BITS", "BatchQuantizedKVCache", "KVQuant", "QuantizedRowCache", "batchable", "check_model", "make_cache",
           "plain", "unquantized"]

BITS = (4, 8)  # what MLXQ_KV_BITS may be: mlx-lm's quantized attention is tested at these

Parts = tuple[mx.array, mx.array, mx.array]  # mx.quantize's (packed, scales, biases)


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How a model's KV cache is quantized: ``bits`` per value (4 or 8), one scale and bias per ``group_size``
    values along the head dimension."""

    bits: int = 8
    group_size: int = 64

    def value_bytes(self, dtype_bytes: int = 2) -> float:
        """Bytes one cached value costs: its bits, plus a scale and a bias (in the KV dtype) per group."""
        return self.bits / 8 + 2 * dtype_bytes / self.group_size

    def check(self, head_dims: Sequence[int]) -> str | None:
        """Why this cannot quantize a cache whose heads have ``head_dims`` values (None: it can)."""
        if self.bits not in BITS:
            return f"{self.bits} bits (expected one of {', '.join(map(str, BITS))})"
        bad = sorted({d for d in head_dims if d % self.group_size})
        if bad:
            return f"group size {self.group_size} does not divide the head dimension {bad[0]}"
        return None


class QuantizedRowCache(QuantizedKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """One sequence's quantized KV cache (mlx-lm's ``QuantizedKVCache``) that can join a batch (``merge``)."""

    keys: Any  # (packed, scales, biases), or None while empty
    values: Any

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """The rows ``caches`` as one batch cache (what mlx-lm's generator calls on a row's layer cache)."""
        return BatchQuantizedKVCache.merge(caches)

    def size(self) -> int:
        return int(self.offset)

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (mlx-lm's fails on an empty cache, which a row waiting to be prefilled holds)."""
        if self.keys is None or self.values is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


class BatchQuantizedKVCache(BatchKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``BatchKVCache`` (rows left-padded to the longest) with keys and values quantized: each a triple
    (packed, scales, biases) along the same axes, so every row operation maps over the three arrays."""

    keys: Any  # Parts, or None while empty (mlx-lm's base class declares None)
    values: Any
    ragged_class: ClassVar[type[Any]]  # its form in a speculating batch (engine/mlx/ragged_cache.py's ragged())

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits  # mlx-lm's attention takes the quantized path when a cache has ``bits``

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            self._grow(keys, values)
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + n
        self._idx += n
        for buf, new in ((self.keys, mx.quantize(keys, group_size=self.group_size, bits=self.bits)),
                         (self.values, mx.quantize(values, group_size=self.group_size, bits=self.bits))):
            for part, fresh in zip(buf, new):
                part[..., prev:self._idx, :] = fresh
        return self.keys_and_values()

    def _grow(self, keys: mx.array, values: mx.array) -> None:
        """Room for ``keys``' positions, in steps of ``step`` as mlx-lm's caches grow."""
        positions = -(-keys.shape[2] // self.step) * self.step
        new_k, new_v = self._fresh(keys, positions), self._fresh(values, positions)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
            return
        kept = self._idx
        self.keys = _map(lambda x, y: mx.concatenate([x[..., :kept, :], y], axis=2), self.keys, new_k)
        self.values = _map(lambda x, y: mx.concatenate([x[..., :kept, :], y], axis=2), self.values, new_v)

    def _fresh(self, like: mx.array, positions: int) -> Parts:
        """Zeroed quantized buffers for ``positions`` of float ``like``'s rows and heads."""
        b, heads, _, dim = like.shape
        return (mx.zeros((b, heads, positions, dim * self.bits // 32), mx.uint32),
                mx.zeros((b, heads, positions, dim // self.group_size), like.dtype),
                mx.zeros((b, heads, positions, dim // self.group_size), like.dtype))

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        end = self._idx
        return _map(lambda x: x[..., :end, :], self.keys), _map(lambda x: x[..., :end, :], self.values)

    def finalize(self) -> None:
        if self._right_padding is None:
            return
        padding = self._right_padding[:, None]
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda x: dynamic_roll(x, padding, axis=2), self.keys)
            self.values = _map(lambda x: dynamic_roll(x, padding, axis=2), self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(_ints(self.left_padding))  # padding every kept row has: cut it off
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other
        ours, theirs = self._aligned(top, size, ref), other._aligned(top, size, ref)
        self.keys = _map(lambda a, b: mx.concatenate([a, b]), ours[0], theirs[0])
        self.values = _map(lambda a, b: mx.concatenate([a, b]), ours[1], theirs[1])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding + top - self._idx,
                                            other.left_padding + top - other._idx])
        self._idx = top

    def _aligned(self, top: int, size: int, ref: BatchQuantizedKVCache) -> tuple[Parts, Parts]:
        """Its buffers, ``size`` positions long, with its rows ending at ``top`` (``ref``: a cache with buffers,
        whose shapes an empty one borrows)."""
        rows, left = int(self.offset.shape[0]), top - self._idx

        def fit(x: mx.array | None, like: mx.array) -> mx.array:
            if x is None:
                x = mx.zeros((rows, like.shape[1], 0, like.shape[3]), like.dtype)
            x = x[..., :size - left, :]
            right = size - left - x.shape[2]
            return mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]) if left or right else x

        assert ref.keys is not None and ref.values is not None
        keys = tuple(fit(None if self.keys is None else self.keys[i], ref.keys[i]) for i in range(3))
        values = tuple(fit(None if self.values is None else self.values[i], ref.values[i]) for i in range(3))
        return keys, values  # type: ignore[return-value]  # three each

    def extract(self, idx: int) -> QuantizedRowCache:
        cache = QuantizedRowCache(self.group_size, self.bits)
        if self.keys is None or self.values is None:
            return cache
        start, end = _ints(self.left_padding)[idx], self._idx
        cache.keys = _map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]), self.keys)
        cache.values = _map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]), self.values)
        cache.offset = end - start
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """Rows' :class:`QuantizedRowCache` as one batch, each right-aligned to the longest."""
        lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], caches[0].group_size, caches[0].bits)
        if longest == 0:
            return batch
        ref = next(c for c, n in zip(caches, lengths) if n)

        def stack(pick: Callable[[Any], Parts]) -> Parts:
            out = []
            for i, like in enumerate(pick(ref)):
                buf = mx.zeros((len(caches), like.shape[1], longest, like.shape[3]), like.dtype)
                for row, (c, n) in enumerate(zip(caches, lengths)):
                    if n:
                        buf[row:row + 1, :, longest - n:] = pick(c)[i][..., :n, :]
                out.append(buf)
            return tuple(out)  # type: ignore[return-value]  # three

        batch.keys, batch.values = stack(lambda c: c.keys), stack(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


class RaggedQuantizedKVCache(RaggedKVCache, BatchQuantizedKVCache):  # type: ignore[misc]
    """:class:`BatchQuantizedKVCache` whose rows end where their own tokens end (``engine/mlx/ragged_cache.py``'s
    :class:`RaggedKVCache`, which a speculating batch rolls back per row): the same bookkeeping over the quantized
    triples."""

    def _take(self, at: mx.array) -> None:
        self.keys, self.values = _map(lambda x: x[at], self.keys), _map(lambda x: x[at], self.values)

    def _write(self, at: mx.array, keys: mx.array, values: mx.array) -> None:
        def put(buf: Parts, new: mx.array) -> Parts:
            parts = cast(Parts, tuple(mx.quantize(new, group_size=self.group_size, bits=self.bits)))
            return _map(lambda x, y: mx.put_along_axis(x, mx.broadcast_to(at, y.shape), y, axis=2), buf, parts)

        self.keys, self.values = put(self.keys, keys), put(self.values, values)

    def _fetch(self, end: int | None) -> tuple[Any, Any]:
        if end is None:
            return self.keys, self.values
        return _map(lambda x: x[..., :end, :], self.keys), _map(lambda x: x[..., :end, :], self.values)

    def width(self) -> int:
        return 0 if self.keys is None else int(self.keys[0].shape[2])

    def _reserve(self, size: int, keys: Any, values: Any) -> None:
        if self.keys is not None and size <= self.width():
            return
        kept = 0 if self.keys is None else self._idx
        grow = -(-size // self.step) * self.step - kept
        if self.keys is None:  # ``keys``, ``values``: the float ones about to be written
            self.keys, self.values = self._fresh(keys, grow), self._fresh(values, grow)
            return
        self.keys = _map(lambda x: mx.concatenate([x[..., :kept, :], _zeros(x, grow)], axis=2), self.keys)
        self.values = _map(lambda x: mx.concatenate([x[..., :kept, :], _zeros(x, grow)], axis=2), self.values)

    def extract(self, idx: int) -> QuantizedRowCache:  # type: ignore[override]  # a quantized row
        cache = QuantizedRowCache(self.group_size, self.bits)
        if self.keys is None:
            return cache
        start, end = _ints(self.left_padding)[idx], self.ends[idx]
        cache.keys = _map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]), self.keys)
        cache.values = _map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]), self.values)
        cache.offset = end - start
        return cache


BatchQuantizedKVCache.ragged_class = RaggedQuantizedKVCache


def _zeros(like: mx.array, positions: int) -> mx.array:
    """Zeros of ``like``'s rows, heads, width and dtype, for ``positions``."""
    return mx.zeros((like.shape[0], like.shape[1], positions, like.shape[3]), like.dtype)


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer array's values."""
    return [int(v) for v in cast(list[int], a.tolist())]


def _leaves(caches: Sequence[Any]) -> list[Any]:
    """The layer caches of ``caches``, with mlx-lm's ``CacheList`` (several caches for one layer) opened."""
    return [leaf for c in caches for leaf in (c.caches if isinstance(c, CacheList) else (c,))]


def _map(fn: Callable[..., mx.array], *parts: Parts) -> Parts:
    """``fn`` over the three arrays of each triple in ``parts``, element by element."""
    return tuple(fn(*xs) for xs in zip(*parts))  # type: ignore[return-value]  # three


def make_cache(model: Any, quant: KVQuant | None) -> list[Any]:
    """A fresh cache for one sequence of ``model``: mlx-lm's, with its plain ``KVCache`` layers (those inside a
    ``CacheList`` too) quantized when ``quant`` is given."""
    caches = make_prompt_cache(model)
    return caches if quant is None else [_quantized(c, quant) for c in caches]


def _quantized(cache: Any, quant: KVQuant) -> Any:
    if type(cache) is KVCache:
        return QuantizedRowCache(quant.group_size, quant.bits)
    if isinstance(cache, CacheList):
        cache.caches = tuple(_quantized(c, quant) for c in cache.caches)
    return cache


def unquantized(model: Any) -> list[str]:
    """The kinds of ``model``'s layer caches that quantization leaves as they are (sliding windows, recurrent
    state), sorted; [] when every layer is quantized."""
    return sorted({type(leaf).__name__ for leaf in _leaves(make_prompt_cache(model)) if type(leaf) is not KVCache})


def batchable(cache: list[Any]) -> list[Any]:
    """A sequence's cache as the batch takes it: mlx-lm's ``QuantizedKVCache`` (as read back from a file) made a
    :class:`QuantizedRowCache` in place (the same state, and ``merge``)."""
    for leaf in _leaves(cache):
        if type(leaf) is QuantizedKVCache:
            leaf.__class__ = QuantizedRowCache
    return cache


def plain(cache: list[Any]) -> list[Any]:
    """A sequence's cache as mlx-lm's classes, for its file format (which names classes it can read back): each
    :class:`QuantizedRowCache` as a ``QuantizedKVCache`` sharing its arrays."""
    return [QuantizedKVCache.from_state(c.state) if type(c) is QuantizedRowCache else c for c in cache]


def check_model(model: Any, quant: KVQuant) -> str | None:
    """Why ``model``'s KV cache cannot be quantized as ``quant`` says (None: it can), from one token run through a
    float cache (its heads' widths) and then a quantized one (a model whose attention cannot take a quantized
    cache fails there: attention sinks, say). Run on the model's MLX thread."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    plain_kv = [leaf for leaf in _leaves(cache) if type(leaf) is KVCache and leaf.keys is not None]
    dims = [int(cast(mx.array, x).shape[-1]) for leaf in plain_kv for x in (leaf.keys, leaf.values)]
    problem = quant.check(dims)
    if problem is not None:
        return problem
    if not dims:
        return "it has no layer whose KV cache grows with the sequence to quantize"
    try:
        quantized = make_cache(model, quant)
        model(mx.array([[0, 1]]), cache=quantized)
        mx.eval([c.state for c in quantized])
    except Exception as exc:  # the model's own attention refuses the quantized cache
        return f"its attention cannot read a quantized cache ({type(exc).__name__}: {exc})"
    return None
