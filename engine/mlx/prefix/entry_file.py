"""One entry of the prefix cache's tier on disk as a file: mlx-lm's prompt-cache format (safetensors) followed
by a trailer with its tokens, its kind, the caller's keys for it and a CRC-32 of everything before it.

MLX reads and writes the arrays by path, never through a Python file object: its callbacks into Python from
another thread deadlock against the MLX thread (the GIL against MLX's own locks).

Durability, by choice: a written entry is not fsynced. A killed process (kill -9 included) loses nothing the
kernel has (its page cache outlives the process), so the restart guarantee holds; only an OS crash or a power
cut can lose or tear files not yet flushed by the kernel, and the checksum catches those on read (the request
prefills cold). The checksum guards against torn and truncated writes and bit rot, not against tampering, which
is why CRC-32 (~1 ms for a 4 MiB entry) serves where SHA-256 cost twice that on the writer; an fsync per file
cost a disk flush each (~250 a round of the kvdisk benchmark) for a case the checksum already covers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from ..quantized_cache import batchable, plain

__all__ = ["FORMAT", "SUFFIX", "TEMP", "Meta", "entry_key", "read_file", "read_meta", "write_file"]

FORMAT = 2  # bumped when the file format changes: a new namespace, old files never read
MAGIC = b"MLXQKV2\n"
_TAIL = struct.Struct("<II8s")  # the JSON header's length, CRC-32 of everything before it, magic
_CRC = 4  # bytes of the CRC in _TAIL
SUFFIX = ".kv.safetensors"  # MLX picks the format by the name
TEMP = ".tmp.safetensors"


@dataclass(frozen=True, slots=True)
class Meta:
    """What an entry's trailer says besides its tokens."""

    kind: str
    trimmable: bool
    keys: tuple[str, ...]
    shared: bool = False  # a prefix other prompts share (a system prompt's): longer entries never supersede it


def write_file(path: Path, tokens: list[int], cache: list[Any], m: Meta) -> int:
    """An entry's whole file at ``path`` (mlx-lm's prompt-cache format, then the trailer), handed to the kernel
    when this returns (or an OSError; not fsynced: see the module docstring); its size."""
    save_prompt_cache(str(path), plain(cache))  # by path: MLX writes the file itself; mlx-lm's classes, to read back
    fields = {"tokens": tokens, "kind": m.kind, "trimmable": m.trimmable, "keys": list(m.keys)}
    if m.shared:  # only then: a file without it reads as not shared (older files too)
        fields["shared"] = True
    meta = json.dumps(fields).encode()
    with open(path, "r+b") as f:
        crc, buf = 0, bytearray(1 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
        crc = zlib.crc32(meta + struct.pack("<I", len(meta)), crc)  # the trailer up to the CRC
        f.write(meta + _TAIL.pack(len(meta), crc, MAGIC))
        return f.tell()


def entry_key(tokens: Iterable[int]) -> str:
    """The name of the entry of ``tokens`` (its file's, less the suffix)."""
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:40]


def _parse_tail(data: bytes) -> tuple[dict[str, Any], int]:
    """An entry's JSON header and where its checksum starts, from the file's last bytes (the whole file, or
    enough of its end)."""
    if len(data) < _TAIL.size:
        raise ValueError("truncated")
    meta_len, _, magic = _TAIL.unpack_from(data, len(data) - _TAIL.size)
    if magic != MAGIC:
        raise ValueError("not an entry of this format (or cut short)")
    crc_at = len(data) - _TAIL.size + 4
    start = crc_at - 4 - meta_len
    if start < 0:
        raise ValueError("truncated")
    meta: dict[str, Any] = json.loads(data[start:start + meta_len])
    return meta, crc_at


def read_meta(path: Path) -> dict[str, Any]:
    """An entry file's JSON header, read from its end (its data is checked when it is read)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < _TAIL.size:
            raise ValueError("truncated")
        f.seek(size - _TAIL.size)
        meta_len = _TAIL.unpack(f.read(_TAIL.size))[0]
        back = min(size, _TAIL.size + 4 + meta_len)
        f.seek(size - back)
        return _parse_tail(f.read(back))[0]


def read_file(path: Path) -> tuple[list[Any], list[int], str]:
    """An entry's evaluated cache (on the calling thread's stream), tokens and kind; ValueError when its checksum
    or trailer is wrong."""
    data = path.read_bytes()
    meta, crc_at = _parse_tail(data)
    if zlib.crc32(memoryview(data)[:crc_at]) != int.from_bytes(data[crc_at:crc_at + _CRC], "little"):
        raise ValueError("checksum mismatch")
    cache = batchable(load_prompt_cache(str(path)))  # by path: MLX reads it itself (safetensors ignore the trailer)
    mx.eval([c.state for c in cache])  # on this thread's own stream, not the model's
    return cache, [int(t) for t in meta["tokens"]], str(meta["kind"])
