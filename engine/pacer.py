"""Paces step outputs: each request's tokens go out at most every ``interval`` seconds, merged.

A small model decodes a step in a millisecond or two; sending every step's tokens as their own events costs
more CPU downstream (events, Redis, every subscriber parsing them) than the step itself, and that CPU comes
out of the decode on a busy host. Holding tokens for a few milliseconds turns many one-token events into
a few larger ones, as vLLM's and SGLang's ``stream_interval`` do, but by time instead of token count, so a
slow model (a step longer than the interval) still streams every step. A request's first token (its time
to first token) and its finish are never held.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .request import RequestOutput, coalesce

__all__ = ["Pacer"]


class Pacer:
    """Holds step outputs until they are due; use from one thread (the engine's)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._held: dict[str, list[RequestOutput]] = {}
        self._last = clock()

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def push(self, outs: list[RequestOutput], flush: bool = False) -> list[RequestOutput]:
        """Take one step's outputs; return what is due now, merged per request (``flush``: everything)."""
        for out in outs:
            self._held.setdefault(out.rid, []).append(out)
        now = self._clock()
        if flush or now - self._last >= self.interval_s:
            self._last = now
            due, self._held = self._held, {}
        else:
            due = {rid: held for rid, held in self._held.items() if any(map(_urgent, held))}
            for rid in due:
                del self._held[rid]
        return coalesce([out for held in due.values() for out in held])


def _urgent(out: RequestOutput) -> bool:
    # completion_tokens counts this output's tokens too: equal means they are the request's first.
    return out.finish is not None or (bool(out.token_ids) and out.completion_tokens == len(out.token_ids))
