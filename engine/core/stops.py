"""Stop strings matched on decoded text, so they work whatever the tokenization.

Text that might be the start of a stop string is held back until the next delta settles it; when a stop
string appears, the output is cut right before it, and the result names the stop string that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StopMatcher", "StopResult"]


@dataclass(frozen=True, slots=True)
class StopResult:
    """Text that is safe to emit now, and the stop string found (None: none yet)."""

    text: str
    stop: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether generation must stop."""
        return self.stop is not None


class StopMatcher:
    """Feeds text deltas through a set of stop strings."""

    __slots__ = ("_held", "_hold", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def feed(self, delta: str) -> StopResult:
        """Add ``delta``; return what can be emitted and whether generation must stop."""
        if not self._stops:
            return StopResult(delta)
        text = self._held + delta
        hit = self._first_stop(text)
        if hit is not None:
            self._held = ""
            cut, stop = hit
            return StopResult(text[:cut], stop)
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep])

    def flush(self) -> str:
        """Release held-back text at the end of a sequence that did not stop on a string."""
        text, self._held = self._held, ""
        return text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the earliest stop string starts, and which (of two starting there, the shorter: it ended
        first)."""
        hits = [(i, len(s), s) for s in self._stops if (i := text.find(s)) >= 0]
        if not hits:
            return None
        i, _, stop = min(hits)
        return i, stop

    def _partial_suffix(self, text: str) -> int:
        # Longest suffix of text that is a proper prefix of some stop string.
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
