"""What a webhook event and a kept result look like, without Redis: the payload and its Standard Webhooks
signature as the openai SDK checks them, and a kept result made back into the events that made it."""

from __future__ import annotations

import base64
import json
import time

import openai
import pytest

from mlxq.api.follow import kept_events
from mlxq.api.gateway.webhooks import payload, sign
from mlxq.api.protocol.jobrecord import read_result, result_record
from mlxq.api.protocol.notify import WebhookEntry
from mlxq.api.schema import DoneEvent, ErrorCode, ErrorEvent, FinishReason, Timings, ToolCall, Usage

pytestmark = pytest.mark.unit

KEY = b"0123456789abcdef0123456789abcdef"
SECRET = "whsec_" + base64.b64encode(KEY).decode()


def test_a_signed_event_unwraps_with_the_sdk_and_a_tampered_one_does_not() -> None:
    entry = WebhookEntry.of(b"1764350000000-3", {b"type": b"response.completed", b"id": b"resp_abc",
                                                 b"tenant": b"acme", b"at_ms": b"1764350000123"})
    body = payload(entry)
    headers = sign(KEY, entry.event_id, int(time.time()), body)
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=SECRET)
    assert (event.id, event.type, event.data.id, event.created_at) == ("evt_1764350000000_3", "response.completed",
                                                                        "resp_abc", 1764350000)
    assert json.loads(body) == {"id": "evt_1764350000000_3", "object": "event", "created_at": 1764350000,
                                "type": "response.completed", "data": {"id": "resp_abc"}}
    stale = sign(KEY, entry.event_id, int(time.time()) - 3600, body)  # past the SDK's 5-minute tolerance
    for bad in (stale, {**headers, "webhook-id": "evt_other"}, sign(b"x" * 32, entry.event_id, int(time.time()),
                                                                       body)):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            openai.OpenAI(api_key="unused").webhooks.verify_signature(body, bad, secret=SECRET)


def test_a_kept_result_is_the_events_that_made_it() -> None:
    call = ToolCall(id="call_1", function={"name": "f", "arguments": "{}"})  # type: ignore[arg-type]
    timings = Timings(queue_ms=1, total_ms=9, ttft_ms=2, tokens_per_s=None)
    end = DoneEvent(id="j", seq=9, finish_reason=FinishReason.TOOL_CALLS, tenant="acme", tool_calls=[call],
                    usage=Usage(prompt_tokens=5, completion_tokens=7), timings=timings)
    kept = read_result(result_record("j", attempt=1, ok=True, event_json=end.model_dump_json(), enqueue_ms=1,
                                     start_ms=2, queue="q", text="hé \"x\"\n", reasoning="why"))
    start, token, done = kept_events("j", kept)
    assert (start.type, start.seq, start.prompt_tokens) == ("start", 7, 5)  # type: ignore[union-attr]
    assert (token.type, token.seq, token.text, token.reasoning) == ("token", 8, "hé \"x\"\n", "why")  # type: ignore[union-attr]
    assert token.tool_calls == [call] and done == end  # type: ignore[union-attr]
    failed = ErrorEvent(id="j", seq=0, code=ErrorCode.EXPIRED, message="late", retryable=True)
    kept = read_result(result_record("j", attempt=0, ok=False, event_json=failed.model_dump_json(), enqueue_ms=1,
                                     start_ms=2, queue="q"))
    assert kept_events("j", kept) == [failed]  # it never ran: its end alone

