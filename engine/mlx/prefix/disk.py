"""The prefix cache's tier on disk (an MLX adapter): KV caches of prompt prefixes kept in files, so a restarted
worker starts from the prefixes it had.

:class:`PrefixDisk` holds one model's entries in one directory (named by the caller after the model's weights and
KV layout: ``directory.py``), each in one file (``entry_file.py``: mlx-lm's prompt-cache format and a trailer
with its tokens and a CRC-32 of everything before it). Files are written to a temporary name and
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
turn unfinished, loses only that checkpoint (the turn's retry prefills cold), and a graceful stop writes it. A
*shared* checkpoint (``save(..., shared=True)``: a system prompt other prompts share) is written at once and never
superseded: a longer entry is one conversation's, the shared prefix many prompts'; only the budget evicts it.

Nothing here runs disk I/O on the model's MLX thread: :meth:`PrefixDisk.save` hands an entry's evaluated
arrays to a writer thread (dropped when more than ``max_pending`` bytes wait), and :meth:`PrefixDisk.load`
reads on a reader thread, which evaluates the arrays on its own stream and queues them for the MLX thread to
take (:meth:`PrefixDisk.arrived`). A write that fails for the disk (full, read-only) turns writing off with
one log line; entries already there are still read. Entries are not fsynced (``entry_file.py`` says why).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import errno
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie

from .entry_file import SUFFIX, TEMP, Meta, entry_key, read_file, read_meta, write_file
from .trie import below, reach

__all__ = ["DiskHit", "PrefixDisk"]

log = logging.getLogger(__name__)

_TRIE = "disk"  # PromptTrie's model key: one model per directory
MAX_ENTRIES = 1024
MAX_TOKENS = 1 << 18  # tokens of every entry together: the index (a trie of them) stays some tens of MiB at most
MAX_PENDING = 1 << 30  # bytes handed to the writer and not written yet; more is dropped, not queued
WAIT_S = 2.0  # a request waits at most this long for its prefix to load, then prefills cold
DEFER_S = 5.0  # a deferred checkpoint's wait for the entry that supersedes it (a turn's end), then it is written


@dataclass(frozen=True, slots=True)
class DiskHit:
    """The entry on disk that holds most of a prompt: its key and how many of the prompt's tokens it holds."""

    key: str
    tokens: int


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    nbytes: int  # of its file
    kind: str
    trimmable: bool
    used: float  # last stored or read (the file's mtime)
    keys: tuple[str, ...] = ()  # the caller's keys for it (PrefixCache.tag)
    shared: bool = False  # never superseded by a longer entry (only evicted)


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
            cache, tokens, kind = read_file(self._path(key))
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
        key = entry_key(tokens)
        with self._lock:
            return key in self._index or key in self._pending

    def save(self, tokens: list[int], cache: list[Any], kind: str, trimmable: bool, *, bounded: bool = True,
             keys: Sequence[str] = (), defer: bool = False, shared: bool = False) -> bool:
        """Hand an entry (its arrays evaluated) to the writer, with the caller's ``keys`` for it (``defer``: after
        ``defer_s``, unless an entry saved meanwhile supersedes it; ``shared``: never superseded); False when it is
        not written: the tier cannot write, it is there already, or (``bounded``) the writer is too far behind."""
        if not self.writable:
            return False
        key = entry_key(tokens)
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
        write = _Write(key, list(tokens), snapshot, Meta(kind, trimmable, tuple(keys), shared), nbytes)
        if defer and not shared and self.defer_s > 0:
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

    def _write(self, key: str, tokens: list[int], cache: list[Any], meta: Meta, nbytes: int) -> None:
        tmp = self.dir / f"{key}.{os.getpid()}.{threading.get_ident()}{TEMP}"
        try:
            if not self.writable:
                return
            self._make_room(nbytes, len(tokens))
            size = write_file(tmp, tokens, cache, meta)
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

    def _commit(self, key: str, tokens: list[int], nbytes: int, meta: Meta) -> None:
        """Index a written entry; a trimmable one makes the entries that are its prefixes redundant."""
        with self._lock:
            self._index[key] = _Entry(tuple(tokens), nbytes, meta.kind, meta.trimmable, time.time(), meta.keys,
                                      meta.shared)
            self._bytes += nbytes
            self._tokens += len(tokens)
            self._trie.add(_TRIE, tokens, key)
            self.counts.writes += 1
            shorter = [k for _, k in self._trie.pop_prefixes(_TRIE, tokens)] if meta.trimmable else []
            for k in [k for k in shorter if k in self._index and self._index[k].shared]:  # many prompts' prefix
                shorter.remove(k)
                self._trie.add(_TRIE, list(self._index[k].tokens), k)
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
            if p.name.endswith(TEMP) or p.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            if not p.name.endswith(SUFFIX):
                continue
            try:
                meta, st = read_meta(p), p.stat()
                found.append((p.name[:-len(SUFFIX)], _Entry(tuple(map(int, meta["tokens"])), st.st_size,
                                                             str(meta["kind"]), bool(meta["trimmable"]),
                                                             st.st_mtime, tuple(map(str, meta.get("keys", ()))),
                                                             bool(meta.get("shared", False)))))
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
        return self.dir / f"{key}{SUFFIX}"


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


@dataclass(slots=True)
class _Write:
    """An entry handed to the writer (or deferred: ``timer`` hands it over)."""

    key: str
    tokens: list[int]
    cache: list[Any]
    meta: Meta
    nbytes: int
    timer: threading.Timer | None = None
