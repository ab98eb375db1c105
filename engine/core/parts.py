"""A sequence's text in its parts: the answer, the reasoning between a model's think markers (``<think>`` ...
``</think>``), and each tool call between its tool-call markers (``<tool_call>`` ... ``</tool_call>``), as
mlx-lm's ``TokenizerWrapper`` names them. The transitions are mlx-lm's text state machine's
(``mlx_lm.generate.make_text_state_machine``): a call may start in the answer or in the reasoning and returns to
the answer. A marker split across text deltas is held back until the next delta settles it; the markers
themselves belong to no part. A call's text goes out whole, once its end marker came; one the sequence's end cut
off is answer text, its start marker included, as the model wrote it, unless the request drops it (its output
constrained to calls: there the cut markup is no answer)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Part", "PartMarkers", "PartSplitter", "Parts"]


class Part(enum.Enum):
    ANSWER = "answer"
    REASONING = "reasoning"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class PartMarkers:
    """A model's markers a request splits its text by (None: that part is not split out), whether its output
    starts inside reasoning (its prompt opened it), and whether a call the sequence's end cut off is dropped."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str] | None = None
    inside: bool = False
    drop_cut_call: bool = False

    def edges(self, part: Part) -> list[tuple[str, Part]]:
        """The markers that leave ``part``, and the part each enters."""
        edges: list[tuple[str, Part]] = []
        if part is Part.TOOL:
            return [(self.tool[1], Part.ANSWER)] if self.tool is not None else []
        if self.think is not None:
            edges.append((self.think[0], Part.REASONING) if part is Part.ANSWER else (self.think[1], Part.ANSWER))
        if self.tool is not None:
            edges.append((self.tool[0], Part.TOOL))
        return edges


@dataclass(slots=True)
class Parts:
    """One delta's text, by part; ``calls``: the tool calls' texts completed in it (their markers left out)."""

    answer: str = ""
    reasoning: str = ""
    calls: list[str] = field(default_factory=list)


class PartSplitter:
    """Splits one sequence's text deltas into their parts."""

    __slots__ = ("_call", "_drop_cut", "_edges", "_held", "_opener", "_part")

    def __init__(self, markers: PartMarkers) -> None:
        self._drop_cut = markers.drop_cut_call
        self._edges = {part: markers.edges(part) for part in Part}
        self._part = Part.REASONING if markers.inside and markers.think is not None else Part.ANSWER
        self._held = ""
        self._call: list[str] = []  # the text of the call in progress
        self._opener = markers.tool[0] if markers.tool is not None else ""

    def feed(self, text: str) -> Parts:
        """The parts of ``text`` (with what was held before it)."""
        text, self._held = self._held + text, ""
        out = Parts()
        while text:
            edges = self._edges[self._part]
            hit = min(((i, marker, to) for marker, to in edges if (i := text.find(marker)) >= 0), default=None,
                      key=lambda h: h[0])
            if hit is not None:
                i, marker, to = hit
                self._put(out, text[:i])
                if self._part is Part.TOOL:
                    out.calls.append("".join(self._call))
                    self._call = []
                text, self._part = text[i + len(marker):], to
                continue
            keep = max((_partial(text, marker) for marker, _ in edges), default=0)
            self._put(out, text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return out

    def flush(self) -> Parts:
        """What is held at the end of the sequence (a marker's start that never completed is text of its part;
        a call without its end marker is answer text, as the model wrote it, or dropped: no call)."""
        out = Parts()
        held, self._held = self._held, ""
        self._put(out, held)
        if self._part is Part.TOOL:
            if not self._drop_cut:
                out.answer += self._opener + "".join(self._call)
            self._call = []
        return out

    def _put(self, out: Parts, text: str) -> None:
        if not text:
            return
        if self._part is Part.ANSWER:
            out.answer += text
        elif self._part is Part.REASONING:
            out.reasoning += text
        else:
            self._call.append(text)


def _partial(text: str, marker: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
