"""Reasoning apart from the answer: the text between a model's think markers (``<think>`` ... ``</think>``, as
mlx-lm's ``TokenizerWrapper`` names them) is reasoning, the rest the answer. A marker split across text deltas
is held back until the next delta settles it; the markers themselves are neither."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ThinkMarkers", "ThinkSplitter"]


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """A model's think markers, and whether its output starts inside reasoning (its prompt opened it)."""

    start: str
    end: str
    inside: bool = False


class ThinkSplitter:
    """Splits one sequence's text deltas into (answer, reasoning) deltas."""

    __slots__ = ("_held", "_inside", "_markers")

    def __init__(self, markers: ThinkMarkers) -> None:
        self._markers = markers
        self._inside = markers.inside
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The answer and the reasoning in ``text`` (with what was held before it)."""
        text, self._held = self._held + text, ""
        answer: list[str] = []
        reasoning: list[str] = []
        while text:
            marker = self._markers.end if self._inside else self._markers.start
            out = reasoning if self._inside else answer
            i = text.find(marker)
            if i >= 0:
                out.append(text[:i])
                text = text[i + len(marker):]
                self._inside = not self._inside
                continue
            keep = _partial(text, marker)
            out.append(text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(answer), "".join(reasoning)

    def flush(self) -> tuple[str, str]:
        """What is held at the end of the sequence (a marker's start that never completed is text)."""
        held, self._held = self._held, ""
        return ("", held) if self._inside else (held, "")


def _partial(text: str, marker: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
