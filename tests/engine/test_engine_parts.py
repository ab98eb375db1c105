"""engine.parts: the text between think markers is reasoning, between tool-call markers a call, whatever the
deltas it arrives in."""

from __future__ import annotations

import pytest

from mlxq.engine.core.parts import PartMarkers, PartSplitter
from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from mlxq.engine.core.sequence import Sequence
from tests.engine.fakes import Detok

pytestmark = pytest.mark.unit

THINK = ("<think>", "</think>")
TOOL = ("<tool_call>", "</tool_call>")
MARKERS = PartMarkers(think=THINK)
TEXT = "<think>let me see</think>The answer."


def split(deltas: list[str], markers: PartMarkers = MARKERS) -> tuple[str, str, list[str]]:
    s = PartSplitter(markers)
    parts = [s.feed(d) for d in deltas] + [s.flush()]
    return "".join(p.answer for p in parts), "".join(p.reasoning for p in parts), [c for p in parts for c in p.calls]


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_reasoning_and_answer_are_apart_in_deltas_of_any_size(size: int) -> None:
    assert split(chunks(TEXT, size)) == ("The answer.", "let me see", [])


def test_output_that_starts_inside_reasoning_and_text_without_markers() -> None:
    assert split(["hmm, so</think>", "yes"], PartMarkers(THINK, inside=True)) == ("yes", "hmm, so", [])
    assert split(["no markers at all <thi", "s"]) == ("no markers at all <this", "", [])


def test_a_marker_cut_off_by_the_end_is_text_of_its_part() -> None:
    assert split(["<think>still thinking</th"]) == ("", "still thinking</th", [])


@pytest.mark.parametrize("size", [1, 2, 4, 9, 1000])
def test_tool_calls_leave_the_answer_from_the_answer_or_the_reasoning(size: int) -> None:
    text = ('<think>I should call it<tool_call>{"name": "a"}</tool_call>Then: '
            '<tool_call>{"name": "b"}</tool_call> done')
    markers = PartMarkers(THINK, TOOL)
    assert split(chunks(text, size), markers) == ("Then:  done", "I should call it", ['{"name": "a"}', '{"name": "b"}'])
    # Inline reasoning: the think markers stay in the answer; the calls still leave it.
    assert split(chunks(text, size), PartMarkers(tool=TOOL)) == (
        "<think>I should call itThen:  done", "", ['{"name": "a"}', '{"name": "b"}'])


def test_a_call_cut_off_by_the_end_is_answer_text_as_the_model_wrote_it() -> None:
    assert split(["ok <tool_call>{\"na"], PartMarkers(tool=TOOL)) == ('ok <tool_call>{"na', "", [])


def test_a_call_cut_off_by_the_end_is_dropped_where_the_request_says_so() -> None:
    # Output constrained to calls (tool_choice required or named): the cut markup is no answer.
    assert split(["\n<tool_call>\n{\"na"], PartMarkers(tool=TOOL, drop_cut_call=True)) == ("\n", "", [])


def test_a_sequence_reports_reasoning_and_calls_apart_from_its_text() -> None:
    class Words(Detok):
        WORDS = {1: "<think>", 2: "why", 3: "</think>", 4: "ok", 5: "<tool_call>", 6: "{}", 7: "</tool_call>"}

        def add_token(self, token: int) -> None:
            self._pending += self.WORDS[token]

    req = EngineRequest("r", [9], SamplingParams(max_tokens=7), parts=PartMarkers(THINK, TOOL))
    seq, out = Sequence.of(req, Words(), 0.0, 0), RequestOutput("r")
    assert [seq.accept(t, None, out) for t in range(1, 8)] == [None] * 6 + [FinishReason.LENGTH]
    assert (out.text, out.reasoning, out.calls, out.token_ids) == ("ok", "why", ["{}"], [1, 2, 3, 4, 5, 6, 7])
