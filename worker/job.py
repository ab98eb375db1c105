"""A job as the worker tracks it while it runs: its next event seq, its timings, and who waits for its end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

__all__ = ["Job"]


@dataclass(slots=True)
class Job:
    """One running job. ``seq`` is the next event's sequence number (continues across re-runs)."""

    rid: str
    model: str
    enqueue_time: float  # epoch seconds (arq's enqueue time)
    attempt: int = 1
    token: str = ""  # this run's lease value (worker id + try): writes need it
    seq: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.time)  # this run's start, epoch seconds
    admitted_at: float | None = None  # epoch seconds
    first_token_at: float | None = None
    finished: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def next_seq(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def mark(self, started: bool, has_tokens: bool) -> None:
        now = time.time()
        if started and self.admitted_at is None:
            self.admitted_at = now
        if has_tokens and self.first_token_at is None:
            self.first_token_at = now
