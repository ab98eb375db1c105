"""A response's stream events made from its job's events (``api/gateway/response_events.py``), with no queue: the
order OpenAI streams them in (reasoning first, then the message, then calls), sequence numbers that depend on
nothing but the job's log, a re-run's repeat given once, and the whitespace held beside tool calls."""

from __future__ import annotations

from typing import Any

import pytest

from mlxq.api.gateway.response_events import JobSteps, ResponseEvents, Step, replay
from mlxq.api.schema import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    ToolCall,
    Usage,
)

pytestmark = pytest.mark.unit

JOB = "0123abcd"
CREATED: dict[str, Any] = {"id": f"resp_{JOB}", "object": "response", "created_at": 1000, "status": "in_progress",
                           "background": False, "output": [], "usage": None, "error": None,
                           "incomplete_details": None, "completed_at": None}
CALL = ToolCall(id="call_1", function={"name": "get_time", "arguments": '{"zone":"UTC"}'})  # type: ignore[arg-type]


class Log:
    """A job's events, numbered as a worker numbers them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, kind: str, **fields: Any) -> Log:
        seq = len(self.events)
        if kind == "start":
            self.events.append(StartEvent(id=JOB, seq=seq, model="m", worker="w", prompt_tokens=5))
        elif kind == "token":
            self.events.append(TokenEvent(id=JOB, seq=seq, token_ids=[seq], index=seq, **fields))
        elif kind == "reset":
            self.events.append(ResetEvent(id=JOB, seq=seq, reason="worker lost", attempt=2))
        elif kind == "error":
            self.events.append(ErrorEvent(id=JOB, seq=seq, code=ErrorCode.ENGINE_ERROR, message="boom"))
        else:
            self.events.append(DoneEvent(id=JOB, seq=seq, finish_reason=fields.get("reason", FinishReason.STOP),
                                         usage=Usage(prompt_tokens=5, completion_tokens=seq,
                                                     cached_tokens=fields.get("cached", 0)),
                                         timings=Timings(queue_ms=1, ttft_ms=2, total_ms=2500, tokens_per_s=None),
                                         tool_calls=fields.get("tool_calls")))
        return self


def run(log: Log, created: dict[str, Any] = CREATED, tools: bool = False) -> tuple[list[dict[str, Any]],
                                                                                   ResponseEvents, list[Step]]:
    events = ResponseEvents(created, tools)
    out = events.opening()
    steps_of = JobSteps(JOB)
    steps = [s for ev in log.events for s in steps_of.feed(ev)]
    for step in steps:
        out += events.feed(step)
    return out, events, steps


def test_reasoning_is_an_item_before_the_message_and_the_numbers_run_on() -> None:
    log = (Log().add("start").add("token", text="", reasoning="hm")
           .add("token", text="", reasoning=" ok").add("token", text="Hi").add("token", text="!").add("done"))
    out, events, _ = run(log)
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    reasoning, message = events.response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "hm ok"}]
    assert message["content"][0]["text"] == "Hi!" and message["status"] == "completed"
    assert events.response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert events.response["completed_at"] == 1002  # created_at + the job's own total time: the same anywhere
    assert out[0]["response"]["output"] == [] and out[-1]["response"] == events.response


def test_a_rerun_repeats_nothing_and_a_stored_stream_replays_the_same_events() -> None:
    log = (Log().add("start").add("token", text="Hel").add("reset").add("start").add("token", text="Hello")
           .add("token", text=" you").add("done", reason=FinishReason.LENGTH))
    out, events, steps = run(log)
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta") == "Hello you"
    assert events.response["status"] == "incomplete"
    assert events.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events.response["output"][0]["status"] == "incomplete"
    again = ResponseEvents(CREATED, False)
    assert again.opening() + [e for s in steps for e in again.feed(s)] == out
    assert replay(CREATED, False, steps).response == events.response


def test_each_event_carries_the_response_and_its_items_as_they_were_when_it_was_made() -> None:
    log = Log().add("start").add("token", text="Hi").add("token", text=" there").add("done")
    out, events, _ = run(log)
    by_type = {e["type"]: e for e in out}
    assert by_type["response.created"]["response"]["output"] == []
    assert by_type["response.created"]["response"]["status"] == "in_progress"
    added = by_type["response.output_item.added"]["item"]
    assert added["content"] == [] and added["status"] == "in_progress"
    assert by_type["response.content_part.added"]["part"]["text"] == ""
    assert by_type["response.completed"]["response"]["output"][0]["content"][0]["text"] == "Hi there"
    assert CREATED["output"] == [] and CREATED["status"] == "in_progress"  # the object it was created from too


def test_usage_counts_the_prompt_tokens_the_worker_had_cached_and_older_stored_steps_replay() -> None:
    _, events, steps = run(Log().add("start").add("token", text="Hi").add("done", cached=4))
    assert events.response["usage"]["input_tokens_details"] == {"cached_tokens": 4, "cache_write_tokens": 0}
    assert replay(CREATED, False, steps).response == events.response
    # A response settled before usage counted cached tokens stored three numbers: it replays with none cached.
    (end,) = [s for s in steps if s[0] == "end"]
    older = [*steps[:-1], ["end", {**end[1], "usage": end[1]["usage"][:3]}]]
    assert replay(CREATED, False, older).response["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_calls_are_items_after_the_text_and_whitespace_beside_them_is_no_message() -> None:
    log = (Log().add("start").add("token", text="\n").add("token", text="", tool_calls=[CALL])
           .add("done", reason=FinishReason.TOOL_CALLS, tool_calls=[CALL]))
    out, events, _ = run(log, tools=True)
    (call,) = events.response["output"]
    assert call == {"id": f"fc_{JOB}_0", "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "get_time", "arguments": '{"zone":"UTC"}'}
    assert [e["type"] for e in out[2:]] == ["response.output_item.added", "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]
    # Without calls, held whitespace is content after all.
    _, plain, _ = run(Log().add("start").add("token", text=" ").add("done"), tools=True)
    assert plain.response["output"][0]["content"][0]["text"] == " "


def test_a_background_response_is_queued_until_its_job_starts_and_a_failure_ends_it() -> None:
    created = {**CREATED, "background": True, "status": "queued"}
    out, events, _ = run(Log().add("start").add("token", text="a").add("error"), created)
    assert [e["type"] for e in out[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert out[0]["response"]["status"] == "queued" and out[-1]["type"] == "response.failed"
    assert events.response["status"] == "failed"
    assert events.response["error"] == {"code": "server_error", "message": "boom (engine_error)"}
    _, cancelled, _ = run(Log().add("done", reason=FinishReason.CANCELLED), created)
    assert cancelled.response["status"] == "cancelled" and cancelled.response["output"] == []


@pytest.mark.parametrize("text", ["plain", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\x01", "ünïcödé 🙂 \u2028"])
def test_a_delta_event_is_written_as_json_writes_it(text: str) -> None:
    from mlxq.api.gateway.dialect import dumps, sse
    from mlxq.api.gateway.response_events import frame

    log = Log().add("start").add("token", text="", reasoning=text).add("token", text=text).add("done")
    out, _, _ = run(log)
    deltas = [(e["type"], e["delta"]) for e in out if e["type"].endswith("_text.delta")]
    assert deltas == [("response.reasoning_text.delta", text), ("response.output_text.delta", text)]
    for event in out:  # the hand-written deltas and every other event: the bytes json makes
        assert frame(event) == sse(dumps(event), event["type"])


def test_a_text_step_written_straight_to_its_frame_is_what_its_event_makes() -> None:
    from mlxq.api.gateway.response_events import frame

    log = Log().add("start").add("token", text="", reasoning="hm").add("token", text="Hi")
    for text in (' "there"', "\n", "ünï 🙂"):
        log.add("token", text=text)
    log.add("done")
    steps_of = JobSteps(JOB)
    steps = [s for ev in log.events for s in steps_of.feed(ev)]
    slow, fast = ResponseEvents(CREATED, False), ResponseEvents(CREATED, False)
    slow.opening()
    fast.opening()
    straight = 0
    for step in steps:
        expected = b"".join(frame(e) for e in slow.feed(step))
        got = fast.text_frame(step)
        straight += got is not None
        assert (got if got is not None else b"".join(frame(e) for e in fast.feed(step))) == expected
    assert straight == 3  # the text steps after the message opened ("Hi" opens it; the reasoning is no text step)
    assert fast.response == slow.response and fast.seq == slow.seq
