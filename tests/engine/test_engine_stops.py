"""StopMatcher: stop strings on decoded text, with possible prefixes held back until settled."""

from __future__ import annotations

from engine.stops import StopMatcher, StopResult


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
        assert m.feed(d) == StopResult(d, False)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    m = StopMatcher(("",))
    assert m.feed("abc") == StopResult("abc", False)
    assert m.flush() == ""


def test_text_without_stop_chars_is_emitted_immediately() -> None:
    m = StopMatcher(("END",))
    assert m.feed("hello") == StopResult("hello", False)
    assert m.flush() == ""


def test_stop_inside_one_delta_cuts_before_it() -> None:
    m = StopMatcher(("END",))
    assert m.feed("abc END tail") == StopResult("abc ", True)


def test_stop_at_start_of_delta_emits_nothing() -> None:
    m = StopMatcher(("\n\n",))
    assert m.feed("x") == StopResult("x", False)
    assert m.feed("\n\nmore") == StopResult("", True)


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
    assert m.feed("go ST") == StopResult("go ", False)
    r = m.feed("ART now")  # "STA..." is not "STOP": the held "ST" is released with it
    assert r == StopResult("START now", False)
    assert m.flush() == ""


def test_held_prefix_released_in_order_with_new_text() -> None:
    m = StopMatcher(("abc",))
    emitted, stopped = feed_all(m, ["xa", "b", "x", "yz"])
    assert not stopped
    assert emitted == ["x", "", "abx", "yz"]


def test_overlapping_partial_prefix_then_stop() -> None:
    # "aab": the first "a" is released once it cannot start the stop string; "ab" then matches.
    m = StopMatcher(("ab",))
    assert m.feed("a") == StopResult("", False)
    assert m.feed("a") == StopResult("a", False)
    assert m.feed("b") == StopResult("", True)


def test_multiple_stop_strings_earliest_wins() -> None:
    m = StopMatcher(("world", "lo"))
    assert m.feed("hello world") == StopResult("hel", True)


def test_multiple_stop_strings_earliest_wins_regardless_of_order() -> None:
    for stops in (("B", "A"), ("A", "B")):
        m = StopMatcher(stops)
        assert m.feed("xxAyyB") == StopResult("xx", True)


def test_multiple_stop_strings_across_deltas() -> None:
    m = StopMatcher(("###", "\nUser:"))
    emitted, stopped = feed_all(m, ["answer\nUs", "er: next"])
    assert stopped
    assert "".join(emitted) == "answer"


def test_hold_back_uses_longest_stop_string() -> None:
    m = StopMatcher(("x", "hello"))
    # "hel" could start "hello": held even though the other stop is a single char.
    assert m.feed("say hel") == StopResult("say ", False)
    assert m.feed("lo") == StopResult("", True)


def test_flush_releases_held_text() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("end ST") == StopResult("end ", False)
    assert m.flush() == "ST"
    assert m.flush() == ""  # flush empties the hold


def test_matcher_state_after_flush_starts_fresh() -> None:
    m = StopMatcher(("ab",))
    m.feed("a")
    assert m.flush() == "a"
    # The flushed "a" must not combine with a later "b".
    assert m.feed("b") == StopResult("b", False)


def test_empty_delta_keeps_hold() -> None:
    m = StopMatcher(("ab",))
    assert m.feed("xa") == StopResult("x", False)
    assert m.feed("") == StopResult("", False)
    assert m.feed("b") == StopResult("", True)
