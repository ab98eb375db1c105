"""Stop strings matched on decoded text, so they work whatever the tokenization.

Text that might be the start of a stop string is held back until the next delta settles it; when a stop
string appears, the output is cut right before it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StopMatcher", "StopResult"]


@dataclass(frozen=True, slots=True)
class StopResult:
    """Text that is safe to emit now, and whether a stop string was found."""

    text: str
    stopped: bool


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
            return StopResult(delta, False)
        text = self._held + delta
        cut = self._first_stop(text)
        if cut is not None:
            self._held = ""
            return StopResult(text[:cut], True)
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """Release held-back text at the end of a sequence that did not stop on a string."""
        text, self._held = self._held, ""
        return text

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_suffix(self, text: str) -> int:
        # Longest suffix of text that is a proper prefix of some stop string.
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
