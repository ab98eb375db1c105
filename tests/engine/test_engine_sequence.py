"""engine.core.sequence: one row's tokens become text and an end, one token at a time."""

from __future__ import annotations

import pytest

from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from mlxq.engine.core.sequence import EOS, LENGTH, Sequence
from tests.engine.fakes import Detok

pytestmark = pytest.mark.unit


def row(max_tokens: int = 10, stop: tuple[str, ...] = ()) -> Sequence:
    req = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, stop=stop))
    return Sequence.of(req, Detok(), 0.0, 0)


def feed(seq: Sequence, tokens: list[int], end: str | None, out: RequestOutput) -> FinishReason | None:
    """The scheduler's way: one token at a time (``end``: the backend's for the last), none after the row ends."""
    for i, token in enumerate(tokens):
        finish = seq.accept(token, end if i == len(tokens) - 1 else None, out)
        if finish is not None:
            return finish
    return None


def test_one_token_at_a_time_emits_its_text_and_counts() -> None:
    seq, out = row(), RequestOutput("r")
    assert seq.accept(5, None, out) is None
    assert seq.accept(6, None, out) is None
    assert (out.token_ids, out.text, out.completion_tokens, out.finish) == ([5, 6], "<5><6>", 2, None)
    assert seq.length == 5 and seq.remaining == 8


def test_a_stop_string_inside_an_accepted_run_ends_it_there_and_drops_the_rest() -> None:
    seq, out = row(stop=("<6>",)), RequestOutput("r")
    assert feed(seq, [4, 5, 6, 7, 8], None, out) is FinishReason.STOP
    assert (out.text, out.stop_sequence, out.finish) == ("<4><5>", "<6>", FinishReason.STOP)
    assert out.token_ids == [4, 5, 6] and seq.generated == 3


def test_max_tokens_cuts_an_accepted_run_with_length() -> None:
    seq, out = row(max_tokens=2), RequestOutput("r")
    assert feed(seq, [4, 5, 6], None, out) is FinishReason.LENGTH
    assert (out.token_ids, out.text, out.completion_tokens) == ([4, 5], "<4><5>", 2)


def test_an_end_of_sequence_token_ends_the_row_without_text() -> None:
    seq, out = row(), RequestOutput("r")
    assert feed(seq, [4, 9], EOS, out) is FinishReason.STOP
    assert (out.token_ids, out.text, out.completion_tokens) == ([4], "<4>", 1)


def test_the_backends_length_ends_the_row() -> None:
    seq, out = row(), RequestOutput("r")
    assert seq.accept(4, LENGTH, out) is FinishReason.LENGTH and out.finish is FinishReason.LENGTH


def test_text_held_for_a_possible_stop_string_is_released_at_the_end() -> None:
    seq, out = row(max_tokens=2, stop=("<5>x",)), RequestOutput("r")
    seq.accept(4, None, out)
    assert seq.accept(5, None, out) is FinishReason.LENGTH
    assert out.text == "<4><5>" and out.stop_sequence is None


