"""The one OS thread that owns a model's MLX stream.

MLX binds streams (and lazy arrays) to the thread that made them, and on Metal a second thread entering
the GPU mid-step crashes the process ("A command encoder is already encoding"). So every MLX call for a
model -- load, prefill, decode step, cache work -- is submitted here and runs in order on one thread.

:meth:`MLXThread.call` is cancel-safe: if the awaiting task is cancelled (arq job timeout, worker
shutdown), it still waits for the call to leave MLX before it lets the cancellation through, so whoever
runs next never overlaps it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx

__all__ = ["MLXThread"]

T = TypeVar("T")


class MLXThread:
    """A single-thread executor with its own MLX stream."""

    def __init__(self, name: str = "mlx") -> None:
        self.name = name
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
        self._ready.set()

    @property
    def stream(self) -> mx.Stream:
        """The stream all of this thread's MLX work runs on (valid on this thread only)."""
        if self._stream is None:
            raise RuntimeError("MLX thread has not started; submit a call first")
        return self._stream

    def on_thread(self) -> bool:
        """Whether the caller is this MLX thread."""
        return threading.get_ident() == self._thread_id

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
