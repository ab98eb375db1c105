"""``api.deltas.Whole``: a job's parts gathered from its events, as the client's result and the gateway's whole
response take them."""

from __future__ import annotations

import pytest

from mlxq.api.deltas import Whole
from mlxq.api.schema import (
    DoneEvent,
    FinishReason,
    FunctionCall,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    Usage,
)

pytestmark = pytest.mark.unit

RID = "job-1"
CALL = ToolCall(id="c1", function=FunctionCall(name="f", arguments='{"x": 1}'))


def tok(seq: int, text: str, *ids: int, reasoning: str = "", logprobs: bool = True) -> TokenEvent:
    return TokenEvent(id=RID, seq=seq, text=text, token_ids=list(ids), index=ids[0], reasoning=reasoning,
                      logprobs=[TokenLogprob(token=i, logprob=-float(i)) for i in ids] if logprobs else None)


def done(seq: int, calls: list[ToolCall] | None = None) -> DoneEvent:
    return DoneEvent(id=RID, seq=seq, finish_reason=FinishReason.STOP,
                     usage=Usage(prompt_tokens=3, completion_tokens=2),
                     timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3, tokens_per_s=None), tool_calls=calls)


def gather(*events: StartEvent | TokenEvent | ResetEvent | DoneEvent) -> Whole:
    whole = Whole()
    for ev in events:
        whole.feed(ev)
    return whole


def test_it_joins_a_runs_parts_in_order() -> None:
    whole = gather(StartEvent(id=RID, seq=0, model="m", worker="w", prompt_tokens=3),
                   tok(1, "", 0, reasoning="hm"), tok(2, "Hel", 1, reasoning=", ok"), tok(3, "lo", 2), done(4, [CALL]))
    assert (whole.text, whole.reasoning, whole.token_ids) == ("Hello", "hm, ok", [0, 1, 2])
    assert whole.logprobs is not None and [lp.token for lp in whole.logprobs] == [0, 1, 2]
    assert whole.tool_calls == [CALL]


def test_across_a_reset_nothing_is_counted_twice() -> None:
    whole = gather(tok(1, "Hel", 0, 1, reasoning="let"), tok(2, "lo", 2),
                   ResetEvent(id=RID, seq=3, reason="worker_lost", attempt=2),
                   tok(4, "Hel", 0, 1, reasoning="let"), tok(5, "lo!", 2, 3), done(6))
    assert (whole.text, whole.reasoning, whole.token_ids) == ("Hello!", "let", [0, 1, 2, 3])
    assert whole.logprobs is not None and [lp.token for lp in whole.logprobs] == [0, 1, 2, 3]
    assert whole.tool_calls == []


def test_logprobs_are_none_unless_the_last_run_carried_them() -> None:
    assert gather(tok(1, "a", 0, logprobs=False), done(2)).logprobs is None
    rerun = gather(tok(1, "a", 0), ResetEvent(id=RID, seq=2, reason="shutdown", attempt=2),
                   tok(3, "a", 0, logprobs=False), done(4))
    assert rerun.logprobs is None and rerun.text == "a"
