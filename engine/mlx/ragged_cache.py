"""A batched KV cache in which each row ends where its own tokens end, so a speculative step takes a row's
rejected positions off its end without moving the others (an MLX adapter: mlx-lm's ``BatchKVCache``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

__all__ = ["HeldRows", "RaggedKVCache", "check_cache", "forward", "held_rows", "ragged", "repeat_shapes", "rollback"]


def check_cache(model: Any) -> str | None:
    """Why ``model``'s KV cache cannot be rolled back per row (None: it can): only plain KV caches can."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
    return f"its KV cache ({', '.join(sorted(kinds))}) cannot be rolled back per row" if kinds else None


class RaggedKVCache(BatchKVCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's batched KV cache in which each row ends where its own tokens end (``ends``), so a row takes
    positions off its end without moving the others or copying the cache: the next tokens of a row are written
    at its end, over what it dropped, and each row attends only up to its own end. Rows are left-padded to the
    longest (as in mlx-lm's), which a row that keeps fewer proposals falls behind.

    With :attr:`fixed` it also holds its rows in a bucket (:func:`held_rows`): the first :attr:`real` are the
    batch's, the spare ones after them copies of its last row, so that the shapes of its passes repeat as rows join
    and leave. Every pass through it then feeds the rows it holds (:func:`forward`)."""

    ends: list[int]  # of every row held, spare ones included
    keys: Any
    values: Any

    fixed: bool  # a pass over several positions attends over the whole buffer (see :meth:`make_mask`)
    real: int  # the batch's rows: the first ones held
    most: int  # the most rows a bucket holds (0: no bound; the batch's capacity)

    @classmethod
    def adopt(cls, cache: BatchKVCache, fixed: bool = False, most: int = 0) -> RaggedKVCache:
        """``cache`` (every row ending at its last position) as a ragged cache, in place."""
        cache.__class__ = cls
        adopted = cast(RaggedKVCache, cache)
        rows = int(cache.offset.shape[0])
        adopted.ends = [cache._idx] * rows
        adopted.fixed, adopted.most, adopted.real = fixed, most, rows
        adopted._hold(list(range(rows)))
        return adopted

    def _held(self, rows: int) -> int:
        return held_rows(rows, self.most) if self.fixed else rows

    def _hold(self, rows: list[int]) -> None:
        """Keep rows ``rows`` (indices of those held) as the batch's, and spare copies of the last up to a bucket."""
        self.real = len(rows)
        idx = rows + rows[-1:] * (self._held(len(rows)) - len(rows))
        if not rows or idx == list(range(len(self.ends))):
            return
        at = mx.array(idx)
        if self.keys is not None:
            self._take(at)
        self.offset, self.left_padding = self.offset[at], self.left_padding[at]
        self.ends = [self.ends[i] for i in idx]

    def _take(self, at: mx.array) -> None:
        """Keep the buffers' rows ``at``."""
        self.keys, self.values = self.keys[at], self.values[at]

    @property
    def _even(self) -> bool:
        return all(e == self._idx for e in self.ends)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        spread = self.fixed and n > 1
        if self._even and not spread:
            out = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return out  # type: ignore[no-any-return]
        if spread:
            self._align(max(self.ends) + n, keys, values)
        else:
            self._reserve(max(self.ends) + n, keys, values)
        self._write((mx.array(self.ends)[:, None] + mx.arange(n)[None])[:, None, :, None], keys, values)
        self.ends = [e + n for e in self.ends]
        self.offset = self.offset + n
        self._idx = max(self.ends)
        return self._fetch(None if spread else self._idx)

    def _write(self, at: mx.array, keys: mx.array, values: mx.array) -> None:
        """``keys`` and ``values`` written at positions ``at`` (``(B, 1, n, 1)``) of each row."""
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)

    def _fetch(self, end: int | None) -> tuple[Any, Any]:
        """What attention reads: the buffers up to ``end`` (None: whole)."""
        if end is None:
            return self.keys, self.values
        return self.keys[..., :end, :], self.values[..., :end, :]

    def width(self) -> int:
        """Positions the buffers hold."""
        return 0 if self.keys is None else int(self.keys.shape[2])

    def _reserve(self, size: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``size`` positions, grown as mlx-lm grows its buffers (steps of ``self.step``)."""
        if self.keys is not None and size <= self.width():
            return
        b, heads, _, dk = keys.shape
        grow = -(-size // self.step) * self.step - (0 if self.keys is None else self._idx)
        new_k = mx.zeros((b, heads, grow, dk), keys.dtype)
        new_v = mx.zeros((b, heads, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[..., :self._idx, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., :self._idx, :], new_v], axis=2)

    def _align(self, size: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``size`` positions in a buffer of whole steps (a filter's shift leaves it ragged), the same
        in every layer's cache."""
        have = self.width()
        self._reserve(-(-max(size, have) // self.step) * self.step, keys, values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:  # mlx-lm's name
        """The mask of a pass over ``N`` new positions. With :attr:`fixed`, a pass over several positions
        attends over the whole buffer (its length moves in steps of 256), the positions past each row's end
        masked: on CUDA an attention over several query positions runs a cuDNN graph built and cached per exact
        shape, and a key length that grows by a different amount every step built a new graph every step."""
        spread = self.fixed and N > 1
        if self._even and not spread:
            return super().make_mask(N, return_array=return_array, **kwargs)
        width = max(self.ends) + N
        if spread and self.keys is None:  # the buffer the pass will make (:meth:`_align`)
            width = -(-width // self.step) * self.step
        elif spread:
            self._align(width, self.keys, self.values)
            width = self.width()
        query = mx.array(self.ends)[:, None] + mx.arange(N)[None]  # each row's new positions
        key = mx.arange(width)[None, None]
        mask = (key <= query[:, :, None]) & (key >= self.left_padding[:, None, None])
        return mask[:, None]

    def retreat(self, drop: Sequence[int]) -> None:
        """Take ``drop[i]`` positions off the end of row ``i`` (spare rows as their batch's last row)."""
        drop = list(drop)
        drop += drop[self.real - 1:self.real] * (len(self.ends) - len(drop))
        self.ends = [e - d for e, d in zip(self.ends, drop)]
        self.offset = self.offset - mx.array(drop)
        self._idx = max(self.ends)

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self.retreat([n] * len(self.ends))
        return n

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        keep += keep[-1:] * (self._held(len(keep)) - len(keep))  # spare rows: copies of the last one kept
        ends = [self.ends[i] for i in keep]
        shift = self._idx
        super().filter(mx.array(keep) if self.fixed else batch_indices)
        shift -= self._idx  # the padding every kept row had, cut from their fronts
        self.ends = [e - shift for e in ends]
        self._idx = max(self.ends)
        self.real = len(batch_indices)

    def extend(self, other: Any) -> None:
        ours, real = self.ends, self.real
        held = len(ours)
        theirs = other.ends if isinstance(other, RaggedKVCache) else [other._idx] * int(other.offset.shape[0])
        added = other.real if isinstance(other, RaggedKVCache) else len(theirs)
        top = max(self._idx, other._idx)
        base_self, base_other = self._idx, other._idx
        super().extend(other)
        self.ends = [e + top - base_self for e in ours] + [e + top - base_other for e in theirs]
        self._idx = max(self.ends)
        self._hold([*range(real), *range(held, held + added)])  # the spare rows of both left out

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        start, end = _ints(self.left_padding)[idx], self.ends[idx]
        cache.keys = mx.contiguous(self.keys[idx:idx + 1, :, start:end])
        cache.values = mx.contiguous(self.values[idx:idx + 1, :, start:end])
        cache.offset = end - start
        return cache


def ragged(caches: list[Any], fixed: bool = False, most: int = 0) -> list[Any]:
    """A batch's caches as :class:`RaggedKVCache` (adopted in place; ``fixed``: see :meth:`RaggedKVCache.make_mask`;
    ``most``: the most rows a bucket holds)."""
    # A batch cache may name its ragged form (a quantized one: engine/mlx/quantized_cache.py).
    return [c if isinstance(c, RaggedKVCache) else getattr(c, "ragged_class", RaggedKVCache).adopt(c, fixed, most)
            for c in caches]


def held_rows(rows: int, most: int = 0) -> int:
    """The rows a batch of ``rows`` holds where shapes repeat: 1, 2, 4, 8, then whole eights (no more than ``most``
    where that holds them), so rows joining and leaving move a pass between a few shapes."""
    size = 1 << max(0, rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8
    return min(size, most) if most >= rows else size


def forward(model: Any, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
    """``model`` over ``inputs`` (one row each of the batch's) through ``cache``: where it holds spare rows, they are
    fed copies of the last row's inputs (so they stay copies of it) and their outputs dropped."""
    rows = inputs.shape[0]
    held = len(cache[0].ends) if cache and isinstance(cache[0], RaggedKVCache) else rows
    if held == rows:
        return model(inputs, cache=cache)  # type: ignore[no-any-return]
    spare = mx.broadcast_to(inputs[-1:], (held - rows, *inputs.shape[1:]))
    return model(mx.concatenate([inputs, spare]), cache=cache)[:rows]  # type: ignore[no-any-return]


class HeldRows:
    """A model whose every call goes through :func:`forward` (a batch's decode steps, as mlx-lm calls its model)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, inputs: mx.array, cache: Sequence[Any]) -> mx.array:
        return forward(self.model, inputs, cache)


def repeat_shapes() -> bool:
    """Whether passes over several positions should keep their shapes from step to step: on MLX's CUDA
    backend (cuDNN attention graphs are built per exact shape); elsewhere attention costs no build per shape and
    attending over a whole buffer would cost more than it saves."""
    return mx.default_device() == mx.gpu and bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def rollback(cache: Sequence[Any], drop: Sequence[int]) -> None:
    """Take ``drop[i]`` positions off the end of row ``i`` in a batch's ragged caches (no copy)."""
    if any(drop):
        for c in cache:
            c.retreat(drop)


def _ints(a: mx.array) -> list[int]:
    """A 1-D integer (or boolean) array's values."""
    return [int(v) for v in cast(list[int], a.tolist())]
