"""The prefix cache's tier on disk (an MLX adapter): KV caches of prompt prefixes kept in files, so a restarted
worker starts from the prefixes it had.

:class:`PrefixDisk` holds one model's entries in one directory (named by the caller after the model's weights and
KV layout, :func:`namespace`): each a file of mlx-lm's prompt-cache format (safetensors) followed by a
trailer with its tokens and a CRC-32 of everything before it. Files are written to a temporary name and
renamed, so a half-written file (a kill mid-write, a full disk) never has an entry's name; a file whose checksum
does not match is logged once, deleted, and its request prefills cold. The tier holds at most
``max_bytes`` in at most ``max_entries`` files, least recently used out first (a file's mtime is its last use,
so the order survives a restart), and the index in memory holds at most ``MAX_TOKENS`` tokens of them. An
entry's trailer also carries the caller's keys for it (opaque strings: the worker's affinity keys), listed at
the start by :meth:`PrefixDisk.tagged`.

A checkpoint of a prompt still being answered (``save(..., defer=True)``: a system prompt's) waits ``defer_s``
before its write: when its turn ends first, the turn's entry (trimmable, so it holds the checkpoint's tokens too)
supersedes it and it is never written (an entry's shorter prefixes are deleted when it lands anyway). On a stream
of prompts that never repeat that halves the writes; a worker killed within ``defer_s`` of a first prefill, its
turn unfinished, loses only that checkpoint (the turn's retry prefills cold), and a graceful stop writes it.

Nothing here runs disk I/O on the model's MLX thread: :meth:`PrefixDisk.save` hands an entry's evaluated
arrays to a writer thread (dropped when more than ``max_pending`` bytes wait), and :meth:`PrefixDisk.load`
reads on a reader thread, which evaluates the arrays on its own stream and queues them for the MLX thread to
take (:meth:`PrefixDisk.arrived`). MLX reads and writes the arrays by path, never through a Python file
object: its callbacks into Python from another thread deadlock against the MLX thread (the GIL against
MLX's own locks). A write that fails for the disk (full, read-only) turns writing off with
one log line; entries already there are still read.

Durability, by choice: a written entry is not fsynced. A killed process (kill -9 included) loses nothing the
kernel has (its page cache outlives the process), so the restart guarantee holds; only an OS crash or a power
cut can lose or tear files not yet flushed by the kernel, and the checksum catches those on read (the request
prefills cold). The checksum guards against torn and truncated writes and bit rot, not against tampering, which
is why CRC-32 (~1 ms for a 4 MiB entry) serves where SHA-256 cost twice that on the writer; an fsync per file
cost a disk flush each (~250 a round of the kvdisk benchmark) for a case the checksum already covers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import errno
import gc
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import PromptTrie, load_prompt_cache, make_prompt_cache, save_prompt_cache

__all__ = ["DiskHit", "PrefixDisk", "Reach", "default_dir", "layout_key", "model_key", "namespace", "reach"]

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when the file format changes: a new namespace, old files never read
MAGIC = b"MLXQKV2\n"
_TAIL = struct.Struct("<II8s")  # the JSON header's length, CRC-32 of everything before it, magic
_CRC = 4  # bytes of the CRC in _TAIL
_SUFFIX = ".kv.safetensors"  # MLX picks the format by the name
_TEMP = ".tmp.safetensors"
_TRIE = "disk"  # PromptTrie's model key: one model per directory
MAX_ENTRIES = 1024
MAX_TOKENS = 1 << 18  # tokens of every entry together: the index (a trie of them) stays some tens of MiB at most
MAX_PENDING = 1 << 30  # bytes handed to the writer and not written yet; more is dropped, not queued
WAIT_S = 2.0  # a request waits at most this long for its prefix to load, then prefills cold
DEFER_S = 5.0  # a deferred checkpoint's wait for the entry that supersedes it (a turn's end), then it is written


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


def layout_key(model: Any) -> str:
    """A digest of what the model's KV caches hold (on its MLX thread): each layer's cache class and its
    arrays' dtypes and shapes after one token (so KV quantization or another dtype gets another key)."""
    cache = make_prompt_cache(model)
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


@dataclass(frozen=True, slots=True)
class DiskHit:
    """The entry on disk that holds most of a prompt: its key and how many of the prompt's tokens it holds."""

    key: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Reach:
    """How far a prompt goes into a trie of entries (mlx-lm's ``PromptTrie``), found by one walk down its tokens.

    mlx-lm's ``PromptTrie.search`` finds the shortest entry longer than the prompt by a depth-first walk of
    everything below where the prompt leaves the trie, copying the path at each step: ~1 ms a prompt at a few
    hundred tokens and 32 entries, run for every idle affinity key each heartbeat (on the MLX thread), so with
    the tier on (whose keys stay held) it grew with the disk's entries. Any entry below serves the callers here
    (a longer entry is trimmed to the common part), and every node of the trie has one at or below it (an entry
    popped takes its emptied nodes with it), so one walk down the tokens and one down a branch suffice."""

    walked: int  # tokens the prompt shares with some entry at or below where it stopped
    exact: Any  # the value of the entry of exactly the prompt's tokens, or None
    shorter: Any  # the value of the longest entry that is a proper prefix of the prompt, or None
    shorter_len: int
    node: dict[Any, Any]  # where the walk stopped (holds an entry at or below it when walked > 0)


def reach(trie: PromptTrie, model: Any, tokens: Sequence[int]) -> Reach:
    """One walk of ``tokens`` down ``trie``'s entries of ``model`` (see :class:`Reach`)."""
    node: dict[Any, Any] = trie._trie.get(model, {})  # mlx-lm's trie as 0.32 keeps it: nested dicts by token
    shorter, shorter_len, walked = None, 0, 0
    for tok in tokens:
        if "__value__" in node:
            shorter, shorter_len = node["__value__"], walked
        nxt = node.get(tok)
        if nxt is None:
            break
        node, walked = nxt, walked + 1
    exact = node.get("__value__") if walked == len(tokens) else None
    return Reach(walked, exact, shorter if shorter_len > 0 else None, shorter_len, node)


def below(node: dict[Any, Any]) -> Any:
    """The value of an entry at or below ``node`` (down its first branch each step); None if there is none
    (never, while the trie is kept as mlx-lm keeps it)."""
    while "__value__" not in node:
        if not node:
            return None
        node = next(iter(node.values()))
    return node["__value__"]


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    nbytes: int  # of its file
    kind: str
    trimmable: bool
    used: float  # last stored or read (the file's mtime)
    keys: tuple[str, ...] = ()  # the caller's keys for it (PrefixCache.tag)


@dataclass(slots=True)
class _Counts:
    hits: int = 0  # entries read and handed to the MLX thread
    misses: int = 0  # lookups that found nothing on disk worth reading (counted by the caller)
    errors: int = 0  # entries that could not be read (corrupt, unreadable): their requests prefilled cold
    writes: int = 0
    dropped: int = 0  # entries not written: the writer was behind
    logged: set[str] = field(default_factory=set)


class PrefixDisk:
    """One model's prefix entries on disk, in ``directory``; see the module docstring."""

    def __init__(self, directory: Path, max_bytes: int, *, max_entries: int = MAX_ENTRIES,
                 max_pending: int = MAX_PENDING, wait_s: float = WAIT_S, defer_s: float = DEFER_S) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_pending = max_pending
        self.wait_s = wait_s
        self.defer_s = defer_s
        self.counts = _Counts()
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._trie = PromptTrie()
        self._bytes = 0
        self._tokens = 0  # of every entry indexed
        self._pending: set[str] = set()
        self._pending_bytes = 0
        self._deferred: dict[str, _Write] = {}  # pending too, waiting for an entry to supersede them
        self._loading: set[str] = set()
        self._arrived: list[tuple[list[int], list[Any], str]] = []
        self.writable = self.readable = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self.writable = self.readable = False
            log.warning("prefix cache on disk off: cannot use %s (%s)", self.dir, exc.strerror or exc)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxq-kv-write")
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxq-kv-read")

    # --- state -------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the entries' files."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    # --- lookups and reads (called on the MLX thread; the I/O runs on the reader thread) ------------
    def lookup(self, tokens: list[int]) -> DiskHit | None:
        """The entry on disk holding the longest prefix of ``tokens`` (a longer entry counts for what it shares
        if it can be trimmed), or None."""
        if not self.readable:
            return None
        with self._lock:
            found = reach(self._trie, _TRIE, tokens)
            if found.exact is not None:
                return DiskHit(found.exact, len(tokens))
            if found.walked > found.shorter_len:  # an entry longer than the part in common: trimmed to it
                key = below(found.node)
                if key is not None and self._index[key].trimmable:
                    return DiskHit(key, min(len(tokens) - 1, found.walked))
            if found.shorter is not None:
                return DiskHit(found.shorter, found.shorter_len)
        return None

    def load(self, key: str, done: Callable[[], None]) -> bool:
        """Read entry ``key`` on the reader thread; ``done`` is called once (on another thread) when it has
        arrived (:meth:`arrived`), failed, or ``wait_s`` passed. False (``done`` never called): no read."""
        with self._lock:
            if key not in self._index or key in self._loading:
                return False
            self._loading.add(key)
        once = _Once(done)
        timer = threading.Timer(self.wait_s, once)
        timer.daemon = True
        try:
            future = self._reader.submit(self._read, key)
        except RuntimeError:  # closed
            with self._lock:
                self._loading.discard(key)
            return False
        timer.start()

        def finished(_: concurrent.futures.Future[None]) -> None:
            timer.cancel()
            once()

        future.add_done_callback(finished)
        return True

    def arrived(self) -> list[tuple[list[int], list[Any], str]]:
        """Entries read since the last call: (tokens, evaluated cache, kind), for the memory tier."""
        with self._lock:
            out, self._arrived = self._arrived, []
        return out

    def _read(self, key: str) -> None:
        with self._lock:
            entry = self._index.get(key) if self.readable else None
        try:
            if entry is None:
                return
            cache, tokens, kind = self._read_file(self._path(key))
            if tokens != list(entry.tokens):
                raise ValueError("its tokens are not its name's")
            with contextlib.suppress(OSError):  # a read-only directory keeps the order it had
                os.utime(self._path(key))
            with self._lock:
                self._arrived.append((tokens, cache, kind))
                entry.used = time.time()
                self.counts.hits += 1
        except FileNotFoundError:
            self._forget(key, delete=False)
        except Exception as exc:  # corrupt, truncated, unreadable: never used, the request prefills cold
            self._broken(key, exc)
        finally:
            with self._lock:
                self._loading.discard(key)

    def _read_file(self, path: Path) -> tuple[list[Any], list[int], str]:
        data = path.read_bytes()
        meta, crc_at = _parse_tail(data)
        if zlib.crc32(memoryview(data)[:crc_at]) != int.from_bytes(data[crc_at:crc_at + _CRC], "little"):
            raise ValueError("checksum mismatch")
        cache = load_prompt_cache(str(path))  # by path: MLX reads the file itself (safetensors ignore the trailer)
        mx.eval([c.state for c in cache])  # on this thread's own stream, not the model's
        return cache, [int(t) for t in meta["tokens"]], str(meta["kind"])

    def _broken(self, key: str, exc: BaseException) -> None:
        with self._lock:
            self.counts.errors += 1
            first = key not in self.counts.logged
            self.counts.logged.add(key)
        if first:
            log.warning("prefix cache on disk: entry %s is unreadable (%s); deleted, its request prefills cold",
                        self._path(key).name, exc)
        self._forget(key, delete=True)

    # --- writes (saved on the MLX thread, written on the writer thread) -----------------------------
    def has(self, tokens: list[int]) -> bool:
        """Whether an entry for exactly ``tokens`` is on disk or on its way there."""
        key = _key(tokens)
        with self._lock:
            return key in self._index or key in self._pending

    def save(self, tokens: list[int], cache: list[Any], kind: str, trimmable: bool, *, bounded: bool = True,
             keys: Sequence[str] = (), defer: bool = False) -> bool:
        """Hand an entry (its arrays evaluated) to the writer, with the caller's ``keys`` for it (``defer``: after
        ``defer_s``, unless an entry saved meanwhile supersedes it); False when it is not written: the tier cannot
        write, it is there already, or (``bounded``) the writer is too far behind."""
        if not self.writable:
            return False
        key = _key(tokens)
        nbytes = sum(int(c.nbytes) for c in cache)
        with self._lock:
            if key in self._index or key in self._pending:
                return False
            behind = bounded and self._pending_bytes + nbytes > self.max_pending
            if nbytes > self.max_bytes or len(tokens) > MAX_TOKENS or behind:
                self.counts.dropped += 1
                return False
            self._pending.add(key)
            self._pending_bytes += nbytes
            superseded = self._supersede(tokens) if trimmable else []
        for w in superseded:
            if w.timer is not None:
                w.timer.cancel()
            self._done(w.key, w.nbytes)
        snapshot = [copy.copy(c) for c in cache]  # the caches' attributes as now; the arrays are shared
        write = _Write(key, list(tokens), snapshot, _Meta(kind, trimmable, tuple(keys)), nbytes)
        if defer and self.defer_s > 0:
            write.timer = timer = threading.Timer(self.defer_s, self._submit_deferred, (key,))
            timer.daemon = True
            with self._lock:
                self._deferred[key] = write
            timer.start()
            return True
        return self._submit(write)

    def _supersede(self, tokens: list[int]) -> list[_Write]:
        """The deferred checkpoints that ``tokens`` (a trimmable entry's) begin with, taken out (under the lock)."""
        out = [w for w in self._deferred.values() if len(w.tokens) < len(tokens) and tokens[:len(w.tokens)] == w.tokens]
        for w in out:
            del self._deferred[w.key]
        return out

    def _submit_deferred(self, key: str | None = None) -> None:
        """Hand the deferred checkpoint ``key`` (None: every one) to the writer, if no entry superseded it."""
        with self._lock:
            writes = [self._deferred.pop(k) for k in ([key] if key is not None else list(self._deferred))
                      if k in self._deferred]
        for w in writes:
            if w.timer is not None:
                w.timer.cancel()
            self._submit(w)

    def _submit(self, w: _Write) -> bool:
        try:
            self._writer.submit(self._write, w.key, w.tokens, w.cache, w.meta, w.nbytes)
        except RuntimeError:  # closed
            self._done(w.key, w.nbytes)
            return False
        return True

    def _done(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._pending.discard(key)
            self._pending_bytes -= nbytes

    def _write(self, key: str, tokens: list[int], cache: list[Any], meta: _Meta, nbytes: int) -> None:
        tmp = self.dir / f"{key}.{os.getpid()}.{threading.get_ident()}{_TEMP}"
        try:
            if not self.writable:
                return
            self._make_room(nbytes, len(tokens))
            size = _write_file(tmp, tokens, cache, meta)
            os.replace(tmp, self._path(key))
            self._commit(key, tokens, size, meta)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._writes_off(exc)
        except Exception:
            log.exception("prefix cache on disk: could not write an entry of %d tokens", len(tokens))
        finally:
            self._done(key, nbytes)

    def _writes_off(self, exc: OSError) -> None:
        with self._lock:
            first, self.writable = self.writable, False
        if first:
            why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror or str(exc)
            log.warning("prefix cache on disk: writing off (%s: %s); entries already there are still read", why,
                        self.dir)

    def _commit(self, key: str, tokens: list[int], nbytes: int, meta: _Meta) -> None:
        """Index a written entry; a trimmable one makes the entries that are its prefixes redundant."""
        with self._lock:
            self._index[key] = _Entry(tuple(tokens), nbytes, meta.kind, meta.trimmable, time.time(), meta.keys)
            self._bytes += nbytes
            self._tokens += len(tokens)
            self._trie.add(_TRIE, tokens, key)
            self.counts.writes += 1
            shorter = [k for _, k in self._trie.pop_prefixes(_TRIE, tokens)] if meta.trimmable else []
        for k in shorter:
            self._forget(k, delete=True, in_trie=False)

    def _make_room(self, nbytes: int, tokens: int) -> None:
        """Delete the least recently used entries until an entry of ``nbytes`` and ``tokens`` fits."""
        while True:
            with self._lock:
                over = (self._bytes + nbytes > self.max_bytes or len(self._index) >= self.max_entries
                        or self._tokens + tokens > MAX_TOKENS)
                if not over or not self._index:
                    return
                key = min(self._index, key=lambda k: self._index[k].used)
            self._forget(key, delete=True)

    def _forget(self, key: str, *, delete: bool, in_trie: bool = True) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return
            self._bytes -= entry.nbytes
            self._tokens -= len(entry.tokens)
            if in_trie:
                with contextlib.suppress(KeyError):
                    self._trie.pop(_TRIE, list(entry.tokens))
        if delete:
            with contextlib.suppress(OSError):
                self._path(key).unlink()

    # --- start and stop ----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the entries a previous run left (their headers only) and delete half-written files. It runs
        while the engine is built, so the index is whole before the first job (and frozen out of the collector's
        sight with the rest of the start: worker/host.py)."""
        with _collector_paused():  # a dict per token: the collector's passes over them cost 4x the work itself
            found = self._trailers()
            found.sort(key=lambda kv: kv[1].used, reverse=True)  # the most recent first: they stay within bounds
            for key, entry in found:
                if (len(self._index) >= self.max_entries or self._bytes + entry.nbytes > self.max_bytes
                        or self._tokens + len(entry.tokens) > MAX_TOKENS):
                    with contextlib.suppress(OSError):
                        self._path(key).unlink()
                    continue
                self._index[key] = entry
                self._bytes += entry.nbytes
                self._tokens += len(entry.tokens)
                self._trie.add(_TRIE, list(entry.tokens), key)
        if self._index:
            log.info("prefix cache on disk: %d entries (%.1f MiB) in %s", len(self._index), self._bytes / (1 << 20),
                     self.dir)

    def _trailers(self) -> list[tuple[str, _Entry]]:
        """Every entry file's key and trailer; half-written and unreadable files deleted."""
        found: list[tuple[str, _Entry]] = []
        for p in self.dir.iterdir():
            if p.name.endswith(_TEMP) or p.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            if not p.name.endswith(_SUFFIX):
                continue
            try:
                meta, st = _read_meta(p), p.stat()
                found.append((p.name[:-len(_SUFFIX)], _Entry(tuple(map(int, meta["tokens"])), st.st_size,
                                                             str(meta["kind"]), bool(meta["trimmable"]),
                                                             st.st_mtime, tuple(map(str, meta.get("keys", ()))))))
            except Exception as exc:
                log.warning("prefix cache on disk: entry %s is unreadable (%s); deleted", p.name, exc)
                with contextlib.suppress(OSError):
                    p.unlink()
        return found

    def tagged(self) -> list[tuple[str, list[int]]]:
        """Each key the entries carry, with its entry's tokens, least recently used first (a key on several
        entries: once, with its most recent)."""
        with self._lock:
            entries = sorted(self._index.values(), key=lambda e: e.used)
        latest: dict[str, tuple[int, ...]] = {}
        for e in entries:
            for k in e.keys:
                latest.pop(k, None)  # a more recent entry moves it later
                latest[k] = e.tokens
        return [(k, list(tokens)) for k, tokens in latest.items()]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (blocking) until the writes handed over so far (the deferred ones too) are done; False if
        ``timeout_s`` passed first."""
        self._submit_deferred()
        done = threading.Event()
        try:
            self._writer.submit(done.set)
        except RuntimeError:  # closed: nothing more is written
            return True
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the writes handed over (up to ``timeout_s``), then stop both threads (blocking)."""
        self.readable = False  # reads queued and not started return at once
        flushed = self.flush(timeout_s)
        if not flushed:
            log.warning("prefix cache on disk: writes still running after %.0f s at the stop; left behind", timeout_s)
        for pool, wait in ((self._reader, True), (self._writer, flushed)):
            with contextlib.suppress(RuntimeError):  # closed already
                pool.submit(mx.clear_streams)  # MLX streams left to the process's exit can abort it
            pool.shutdown(wait=wait)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{_SUFFIX}"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for a while (it was on): building many containers at once, each of its
    passes would walk them all again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Once:
    """A callback run at most once, from whichever thread calls first."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


@dataclass(frozen=True, slots=True)
class _Meta:
    """What an entry's trailer says besides its tokens."""

    kind: str
    trimmable: bool
    keys: tuple[str, ...]


@dataclass(slots=True)
class _Write:
    """An entry handed to the writer (or deferred: ``timer`` hands it over)."""

    key: str
    tokens: list[int]
    cache: list[Any]
    meta: _Meta
    nbytes: int
    timer: threading.Timer | None = None


def _write_file(path: Path, tokens: list[int], cache: list[Any], m: _Meta) -> int:
    """An entry's whole file at ``path`` (mlx-lm's prompt-cache format, then the trailer), handed to the kernel
    when this returns (or an OSError; not fsynced: see the module docstring); its size."""
    save_prompt_cache(str(path), cache)  # by path: MLX writes the file itself
    meta = json.dumps({"tokens": tokens, "kind": m.kind, "trimmable": m.trimmable, "keys": list(m.keys)}).encode()
    with open(path, "r+b") as f:
        crc, buf = 0, bytearray(1 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
        crc = zlib.crc32(meta + struct.pack("<I", len(meta)), crc)  # the trailer up to the CRC
        f.write(meta + _TAIL.pack(len(meta), crc, MAGIC))
        return f.tell()


def _key(tokens: Iterable[int]) -> str:
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


def _read_meta(path: Path) -> dict[str, Any]:
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
