"""Bounds a worker's shutdown: SIGTERM (or SIGINT) arms a timer that, if the worker has not closed by the end
of its drain plus a grace period, logs where every asyncio task waits, writes every thread's stack to the
log and exits with status 1.

A shutdown waits for the MLX thread to leave MLX (a second thread entering Metal crashes the process) and
for each interrupted job's hand-back to Redis. If one of those never returns, the worker would hang until
its supervisor's SIGKILL and nothing would say where. ``faulthandler``'s timer runs in C, so it fires (and
dumps the stacks) even while a thread holds the GIL inside a native call. Jobs left running are recovered
as after a crash: the reaper re-queues them when their leases expire.

arq's stop signals arm it and its ``close`` disarms it (``worker.arqseam``), so a Worker embedded in a
longer-lived process is not killed after it closed.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
from typing import Any

__all__ = ["arm", "disarm"]

log = logging.getLogger(__name__)

_THREADS_AFTER_S = 1.0  # the thread dump and exit follow the task dump by this much
_dump: asyncio.TimerHandle | None = None


def arm(timeout_s: float) -> None:
    """Unless disarmed within ``timeout_s``: log every asyncio task's await chain, then (a second later, from C,
    so even if the event loop is stuck) write every thread's stack to stderr (the worker's log) and exit 1."""
    global _dump
    if _dump is not None:  # a second signal keeps the first deadline
        return
    log.info("shutdown watchdog armed: exiting in %.1fs unless closed by then", timeout_s)
    _dump = asyncio.get_running_loop().call_later(timeout_s, _log_tasks)
    faulthandler.dump_traceback_later(timeout_s + _THREADS_AFTER_S, exit=True)


def disarm() -> None:
    global _dump
    if _dump is not None:
        _dump.cancel()
        _dump = None
    faulthandler.cancel_dump_traceback_later()


def _log_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if not t.done()]
    chains = "\n".join(f"{t.get_name()}:\n" + "\n".join(_await_chain(t.get_coro())) for t in tasks)
    log.error("shutdown still running past its grace; %d tasks, each awaiting:\n%s", len(tasks), chains)


def _await_chain(coro: Any) -> list[str]:
    """Where a suspended coroutine waits, outermost first (``Task.get_stack`` gives only the outermost)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines
