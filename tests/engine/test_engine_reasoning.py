"""engine.reasoning: the text between think markers is reasoning, whatever the deltas it arrives in."""

from __future__ import annotations

import pytest

from engine.reasoning import ThinkMarkers, ThinkSplitter
from engine.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from engine.sequence import Sequence
from tests.engine.fakes import Detok

MARKERS = ThinkMarkers("<think>", "</think>")
TEXT = "<think>let me see</think>The answer."


def split(deltas: list[str], markers: ThinkMarkers = MARKERS) -> tuple[str, str]:
    s = ThinkSplitter(markers)
    parts = [s.feed(d) for d in deltas] + [s.flush()]
    return "".join(a for a, _ in parts), "".join(r for _, r in parts)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_reasoning_and_answer_are_apart_in_deltas_of_any_size(size: int) -> None:
    deltas = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert split(deltas) == ("The answer.", "let me see")


def test_output_that_starts_inside_reasoning_and_text_without_markers() -> None:
    assert split(["hmm, so</think>", "yes"], ThinkMarkers("<think>", "</think>", inside=True)) == ("yes", "hmm, so")
    assert split(["no markers at all <thi", "s"]) == ("no markers at all <this", "")


def test_a_marker_cut_off_by_the_end_is_text_of_its_part() -> None:
    assert split(["<think>still thinking</th"]) == ("", "still thinking</th")


def test_a_sequence_reports_reasoning_apart_from_its_text() -> None:
    class Words(Detok):
        WORDS = {1: "<think>", 2: "why", 3: "</think>", 4: "ok"}

        def add_token(self, token: int) -> None:
            self._pending += self.WORDS[token]

    req = EngineRequest("r", [9], SamplingParams(max_tokens=4), thinking=MARKERS)
    seq, out = Sequence.of(req, Words(), 0.0, 0), RequestOutput("r")
    assert seq.accept_many([1, 2, 3, 4], None, out) is FinishReason.LENGTH
    assert (out.text, out.reasoning, out.token_ids) == ("ok", "why", [1, 2, 3, 4])
