"""The one OS thread that owns a model's MLX stream.

MLX binds streams and lazy arrays to the thread that made them, and on Metal a second thread entering the GPU
mid-step crashes the process; so every MLX call for a model runs here, in order. :meth:`MLXThread.call` is
cancel-safe: a cancelled caller still waits for its call to leave MLX, so the next never overlaps it.

On Linux, MLX runs a CPU stream's kernels on a thread of its own, woken for every kernel enqueued; under the
default policy each wake-up preempts the enqueuing thread when the two share a core, a context switch per
kernel. So that thread runs under ``SCHED_BATCH``, whose wake-ups do not preempt (same nice level, same share
of the CPU).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx

__all__ = ["MLXThread"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_spawn_lock = threading.Lock()  # one MLXThread starts its stream's thread at a time: the new thread is its own


class MLXThread:
    """A single-thread executor with its own MLX stream."""

    def __init__(self, name: str = "mlx", *, batch_policy: bool = True) -> None:
        self.name = name
        self.batch_policy = batch_policy  # the stream's kernel thread under SCHED_BATCH (see the module docstring)
        self.kernel_thread: int | None = None  # its native id, once set to SCHED_BATCH
        self._ready = threading.Event()
        self._stream: mx.Stream | None = None
        self._thread_id: int | None = None
        self._queued = 0  # calls submitted and not started yet
        self._queued_lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._init
        )

    def _init(self) -> None:
        self._stream = mx.new_stream(mx.default_device())
        self._thread_id = threading.get_ident()
        if self.batch_policy and self._stream.device == mx.cpu and hasattr(os, "SCHED_BATCH"):
            self.kernel_thread = _batch_kernel_thread(self._stream)
        self._ready.set()

    @property
    def stream(self) -> mx.Stream:
        """The stream all of this thread's MLX work runs on (valid on this thread only)."""
        if self._stream is None:
            raise RuntimeError("MLX thread has not started; submit a call first")
        return self._stream

    def set_kernel_policy(self, batch: bool) -> None:
        """Put the stream's kernel thread under SCHED_BATCH or back under the default policy (the bench
        measures both); a no-op when it was not identified."""
        if self.kernel_thread is not None:
            os.sched_setscheduler(self.kernel_thread, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))

    @property
    def queued(self) -> int:
        """Calls waiting for the thread: a long-running call can yield to them."""
        return self._queued

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the thread, inside this thread's stream."""
        with self._queued_lock:
            self._queued += 1
        try:
            return self._executor.submit(self._run, fn, *args)
        except BaseException:
            with self._queued_lock:
                self._queued -= 1
            raise

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._queued_lock:
            self._queued -= 1
        with mx.stream(self.stream):
            return fn(*args)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` on the thread; a cancelled caller still waits until the call returned."""
        return await wait_shielded(asyncio.wrap_future(self.submit(fn, *args)))

    def shutdown(self) -> None:
        """Finish queued calls, release the stream on its own thread, and join the thread (blocking)."""
        if self._stream is not None:
            with contextlib.suppress(RuntimeError):  # already shut down
                self._executor.submit(self._teardown)
        self._executor.shutdown(wait=True)

    def _teardown(self) -> None:
        # Finish pending work and destroy this thread's streams while the thread is alive: MLX streams left
        # to static destruction at process exit can abort the process.
        if self._stream is not None:
            mx.synchronize(self._stream)
            self._stream = None
        mx.clear_streams()

    async def aclose(self) -> None:
        """:meth:`shutdown` without blocking the event loop; cancel-safe like :meth:`call`."""
        await wait_shielded(asyncio.ensure_future(asyncio.to_thread(self.shutdown)))


def _batch_kernel_thread(stream: mx.Stream) -> int | None:
    """Start ``stream``'s kernel thread (its first evaluation does) and put it under ``SCHED_BATCH``; its
    native thread id, or None when it cannot be told apart (another thread started meanwhile) or set."""
    with _spawn_lock:
        before = _native_threads()
        mx.eval(mx.add(mx.array(0), 1, stream=stream))
        python = {t.native_id for t in threading.enumerate()}  # a Python thread started meanwhile is not it
        new = _native_threads() - before - python
    if len(new) != 1:
        log.debug("MLX stream thread not identified (%d new threads): left under the default policy", len(new))
        return None
    tid = new.pop()
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        log.warning("could not set MLX's stream thread %d to SCHED_BATCH: %s", tid, exc)
        return None
    return tid


def _native_threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


async def wait_shielded(fut: asyncio.Future[T]) -> T:
    """Await ``fut``; if we are cancelled meanwhile, let ``fut`` finish first, then re-raise."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except Exception:
                break
        raise
