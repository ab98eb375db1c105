"""The slots a model's bulk band leaves to its interactive jobs: as many as they held at their recent peak.

An interactive job that ends frees a slot its client usually fills again moments later (a conversation's next turn,
a stream of requests). Taken by a bulk job meanwhile, that slot costs the next interactive job a preemption: a bulk
row's KV cache copied out of the batch, and a claim that must find the engine outranked first. So a model's bulk
claims leave room for as many interactive jobs as the model held at once within the last ``hold_s`` seconds; past
that, the room goes back to the bulk band (and an interactive job beyond the peak still preempts a bulk row).
"""

from __future__ import annotations

__all__ = ["InteractiveReserve"]


class InteractiveReserve:
    """A model's interactive jobs held at once, recent peak and now (``note`` each change; one event loop)."""

    __slots__ = ("_seen", "held", "hold_s")

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.held = 0
        self._seen: list[float] = []  # _seen[k]: when at least k + 1 were last held (so never increasing in k)

    def note(self, held: int, now: float) -> None:
        """The interactive jobs held from now on: every level up to the higher of it and the last was held now."""
        top = max(held, self.held)
        levels = self._seen
        for k in range(min(top, len(levels))):
            levels[k] = now
        levels.extend(now for _ in range(len(levels), top))
        self.held = held

    def peak(self, now: float) -> int:
        """The most interactive jobs held at once within the last ``hold_s`` seconds (now's included)."""
        n = 0
        for seen in self._seen:
            if now - seen >= self.hold_s:
                break
            n += 1
        return max(n, self.held)

    def reserved(self, now: float) -> int:
        """Slots to leave free of bulk jobs: the recent peak's interactive jobs not held now."""
        return self.peak(now) - self.held
