"""StopMatcher: stop strings on decoded text, with possible prefixes held back until settled; and the stop
string that ended a request, on the scheduler's last output of it."""

from __future__ import annotations

import pytest

from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams, coalesce
from mlxq.engine.core.stops import StopMatcher, StopResult
from tests.engine.fakes import Run, ToyBatch, scheduler, toy_generate

pytestmark = pytest.mark.unit


def feed_all(m: StopMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    """Feed deltas until a stop; the emitted pieces and whether it stopped."""
    emitted: list[str] = []
    for d in deltas:
        r = m.feed(d)
        emitted.append(r.text)
        if r.stopped:
            return emitted, True
    return emitted, False


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher(())
    for d in ["Hello", " ", "wor", "ld", ""]:
        assert m.feed(d) == StopResult(d)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    m = StopMatcher(("",))
    assert m.feed("abc") == StopResult("abc")
    assert m.flush() == ""


def test_text_without_stop_chars_is_emitted_immediately() -> None:
    m = StopMatcher(("END",))
    assert m.feed("hello") == StopResult("hello")
    assert m.flush() == ""


def test_stop_inside_one_delta_cuts_before_it() -> None:
    m = StopMatcher(("END",))
    assert m.feed("abc END tail") == StopResult("abc ", "END")


def test_stop_at_start_of_delta_emits_nothing() -> None:
    m = StopMatcher(("\n\n",))
    assert m.feed("x") == StopResult("x")
    assert m.feed("\n\nmore") == StopResult("", "\n\n")


def test_stop_split_across_deltas_is_caught_and_prefix_never_emitted() -> None:
    m = StopMatcher(("STOP",))
    emitted, stopped = feed_all(m, ["Hello S", "T", "O", "P and more"])
    assert stopped
    assert emitted == ["Hello ", "", "", ""]
    assert "".join(emitted) == "Hello "
    assert m.flush() == ""  # nothing left over after a stop


def test_stop_split_over_single_characters() -> None:
    m = StopMatcher(("<|end|>",))
    emitted, stopped = feed_all(m, list("ok<|end|>junk"))
    assert stopped
    assert "".join(emitted) == "ok"


def test_text_that_only_looks_like_a_prefix_is_released_later() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("go ST") == StopResult("go ")
    r = m.feed("ART now")  # "STA..." is not "STOP": the held "ST" is released with it
    assert r == StopResult("START now")
    assert m.flush() == ""


def test_held_prefix_released_in_order_with_new_text() -> None:
    m = StopMatcher(("abc",))
    emitted, stopped = feed_all(m, ["xa", "b", "x", "yz"])
    assert not stopped
    assert emitted == ["x", "", "abx", "yz"]


def test_overlapping_partial_prefix_then_stop() -> None:
    # "aab": the first "a" is released once it cannot start the stop string; "ab" then matches.
    m = StopMatcher(("ab",))
    assert m.feed("a") == StopResult("")
    assert m.feed("a") == StopResult("a")
    assert m.feed("b") == StopResult("", "ab")


def test_multiple_stop_strings_earliest_wins() -> None:
    m = StopMatcher(("world", "lo"))
    assert m.feed("hello world") == StopResult("hel", "lo")


def test_multiple_stop_strings_earliest_wins_regardless_of_order() -> None:
    for stops in (("B", "A"), ("A", "B")):
        m = StopMatcher(stops)
        assert m.feed("xxAyyB") == StopResult("xx", "A")


def test_multiple_stop_strings_across_deltas() -> None:
    m = StopMatcher(("###", "\nUser:"))
    emitted, stopped = feed_all(m, ["answer\nUs", "er: next"])
    assert stopped
    assert "".join(emitted) == "answer"


def test_the_result_names_the_stop_string_found() -> None:
    m = StopMatcher(("###", "\nUser:"))
    assert m.feed("answer\nUs").stop is None
    assert m.feed("er: next") == StopResult("", "\nUser:")


def test_of_stop_strings_starting_at_one_place_the_shorter_is_named() -> None:
    # Both start at "a" in one delta: "ab" was complete first, so it is the one that ended the text.
    for stops in (("abc", "ab"), ("ab", "abc")):
        assert StopMatcher(stops).feed("xabcd") == StopResult("x", "ab")


def test_hold_back_uses_longest_stop_string() -> None:
    m = StopMatcher(("x", "hello"))
    # "hel" could start "hello": held even though the other stop is a single char.
    assert m.feed("say hel") == StopResult("say ")
    assert m.feed("lo") == StopResult("", "hello")


def test_flush_releases_held_text() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("end ST") == StopResult("end ")
    assert m.flush() == "ST"
    assert m.flush() == ""  # flush empties the hold


def test_matcher_state_after_flush_starts_fresh() -> None:
    m = StopMatcher(("ab",))
    m.feed("a")
    assert m.flush() == "a"
    # The flushed "a" must not combine with a later "b".
    assert m.feed("b") == StopResult("b")


def test_empty_delta_keeps_hold() -> None:
    m = StopMatcher(("ab",))
    assert m.feed("xa") == StopResult("x")
    assert m.feed("") == StopResult("")
    assert m.feed("b") == StopResult("", "ab")


# --- in the scheduler: the request's end names the stop string that ended it ------------------------------


PROMPT = [1, 2, 3]
TOKENS = toy_generate(PROMPT, 8)  # what the toy model makes of it; its detokenizer writes token t as "<t>"


def _drained(stops: tuple[str, ...]) -> Run:
    s = scheduler(ToyBatch())
    s.add(EngineRequest("r", PROMPT, SamplingParams(max_tokens=len(TOKENS), stop=stops)))
    run = Run()
    run.drain(s)
    return run


def test_a_request_a_stop_string_ends_names_it_on_its_last_output() -> None:
    tokens = TOKENS
    stop = f"<{tokens[2]}>"
    run = _drained(("<never>", stop))
    end = run.final("r")
    assert end.finish is FinishReason.STOP and end.stop_sequence == stop
    assert run.text("r") == "".join(f"<{t}>" for t in tokens[: tokens.index(tokens[2])])
    assert all(o.stop_sequence is None for o in run.outputs["r"] if o.finish is None)


def test_a_request_that_ends_otherwise_names_no_stop_string() -> None:
    run = _drained(("<never>",))
    end = run.final("r")
    assert end.finish is FinishReason.LENGTH and end.stop_sequence is None
    assert run.text("r") == "".join(f"<{t}>" for t in TOKENS)


def test_merged_outputs_keep_the_stop_string() -> None:
    head = RequestOutput("r", [1], "a", completion_tokens=1)
    tail = RequestOutput("r", [2], "", completion_tokens=2, finish=FinishReason.STOP, stop_sequence="b")
    (merged,) = coalesce([head, tail])
    assert (merged.text, merged.finish, merged.stop_sequence) == ("a", FinishReason.STOP, "b")
