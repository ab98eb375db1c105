"""A response's stream events and its object, made from its job's events, deterministically.

Two steps, each a pure function of what it is fed, so every gateway that reads a job's log makes the same
events with the same ``sequence_number`` s (a background stream resumed through another gateway, or after a
restart, continues where it was):

- :class:`JobSteps` turns the job's events into *steps*: ``["start"]``, ``["delta", text, reasoning, calls]``
  (each piece once across re-runs, as ``api/deltas.py`` gives them) and ``["end", {...}]``. Steps are plain
  JSON: a settled response stores them, and replays its stream from them once the job's log is gone.
- :class:`ResponseEvents` turns steps into OpenAI's stream events and keeps the response object they build:
  created (→ queued) → in_progress → per output item: output_item.added → content_part.added → deltas →
  ...done → output_item.done → completed | incomplete | failed. Reasoning (a reasoning model's thinking,
  ``reasoning="split"``) is a reasoning item of its own, before the message; each tool call a function_call
  item.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any

from ..deltas import Deltas
from ..errors import JobFailed
from ..schema import DoneEvent, ErrorCode, ErrorEvent, Event, FinishReason, StartEvent, TokenEvent
from .dialect import dumps, sse

__all__ = ["JobSteps", "ResponseEvents", "Step", "frame", "lost_step", "replay", "usage"]

Step = list[Any]

_STATUS = {FinishReason.STOP: "completed", FinishReason.TOOL_CALLS: "completed",
           FinishReason.LENGTH: "incomplete", FinishReason.CANCELLED: "cancelled"}
TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_text.delta"
_LIFECYCLE = {"completed": "response.completed", "incomplete": "response.incomplete",
              "failed": "response.failed", "cancelled": "response.failed"}  # OpenAI streams no response.cancelled


class JobSteps:
    """One job's events, in order, as steps (see the module's docstring)."""

    __slots__ = ("_deltas", "_reasoning_tokens", "ended", "started")

    def __init__(self, job_id: str) -> None:
        self._deltas = Deltas(job_id)
        self.started = self.ended = False
        self._reasoning_tokens = 0  # the current run's tokens of reasoning alone

    def feed(self, ev: Event) -> list[Step]:
        if self.ended:
            return []
        if isinstance(ev, StartEvent):
            first, self.started = not self.started, True
            return [["start"]] if first else []
        if isinstance(ev, ErrorEvent):
            return self._end(_failure(ev))
        if isinstance(ev, DoneEvent):
            try:
                self._deltas.end(ev.seq)
            except JobFailed as exc:
                return self._end(_failure(exc.event))
            usage = [ev.usage.prompt_tokens, ev.usage.completion_tokens, self._reasoning_tokens,
                     ev.usage.cached_tokens]
            return self._end({"finish": ev.finish_reason.value, "usage": usage, "total_ms": ev.timings.total_ms})
        if ev.type == "reset":
            self._reasoning_tokens = 0
        elif isinstance(ev, TokenEvent) and ev.reasoning and not ev.text:
            self._reasoning_tokens += len(ev.token_ids)
        try:
            delta = self._deltas.feed(ev)
        except JobFailed as exc:
            return self._end(_failure(exc.event))
        if delta is None:
            return []
        return [["delta", delta.text, delta.reasoning, [c.model_dump() for c in delta.tool_calls] if delta.tool_calls
                 else []]]

    def _end(self, end: dict[str, Any]) -> list[Step]:
        self.ended = True
        return [["end", end]]


def _failure(ev: ErrorEvent) -> dict[str, Any]:
    # OpenAI's error codes are a fixed set: a prompt the worker refused is invalid_prompt, the rest server_error.
    code = "invalid_prompt" if ev.code is ErrorCode.BAD_REQUEST else "server_error"
    return {"error": {"code": code, "message": f"{ev.message} ({ev.code.value})"}}


def lost_step() -> Step:
    """The end of a response whose job the queue no longer knows (its events expired before anyone read them)."""
    return ["end", {"error": {"code": "server_error", "message": "the response's job ended, and its events "
                              "expired, before any gateway recorded its end"}}]


class ResponseEvents:
    """A response's stream events, made from steps; :attr:`response` is the object they describe so far."""

    def __init__(self, created: dict[str, Any], calls_tools: bool) -> None:
        self.response = {**created, "output": []}  # its fields are replaced, never changed in place
        self.background = bool(created.get("background"))
        self.holds = calls_tools  # whitespace is held until what follows shows it is content, as chat's
        self.held = ""
        self.seq = -1
        self.calls = 0
        self._open: tuple[str, int] | None = None  # ("message" | "reasoning", output index) of the item open
        self.ended = False

    @property
    def rid(self) -> str:
        return str(self.response["id"])

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return self._event(kind, response=_snapshot(self.response))

    def opening(self) -> list[dict[str, Any]]:
        """The stream's first events: created (and queued for a background response; in_progress for another,
        which starts when it is asked for)."""
        if self.background:
            return [self._lifecycle("response.created"), self._lifecycle("response.queued")]
        self.response["status"] = "in_progress"
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def feed(self, step: Step) -> list[dict[str, Any]]:
        """The events of one step."""
        kind = step[0]
        if self.ended:
            return []
        if kind == "start":
            if not self.background or self.response["status"] != "queued":
                return []
            self.response["status"] = "in_progress"
            return [self._lifecycle("response.in_progress")]
        if kind == "delta":
            return self._delta(step[1], step[2], step[3])
        return self._end(step[1])

    def text_frame(self, step: Step) -> bytes | None:
        """A step of text alone while a message item is open (most of a stream's steps) straight to its frame: the
        bytes :meth:`feed` then :func:`frame` make, without the event between; None for any other step (feed it)."""
        if (step[0] != "delta" or step[2] or step[3] or not step[1] or self.ended or self.holds
                or self._open is None or self._open[0] != "message"):
            return None
        text, index = step[1], self._open[1]
        item = self.response["output"][index]
        item["content"][0]["text"] += text
        self.seq += 1
        return _delta_frame(TEXT_DELTA, self.seq, item["id"], index, 0, text)

    def _delta(self, text: str, reasoning: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            out += self._append("reasoning", reasoning)
        if self.holds:
            text, self.held = self.held + text, ""
            if not text.strip():
                if not calls:
                    self.held = text
                text = ""
        if text:
            out += self._append("message", text)
        for call in calls:
            out += self._call(call)
        return out

    # --- items ------------------------------------------------------------------------------------------
    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.rid.removeprefix('resp_')}_{index}"

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        """``text`` added to the open item of ``kind`` (one opened first, closing another)."""
        out: list[dict[str, Any]] = []
        if self._open is None or self._open[0] != kind:
            out += self._close("completed")
            out += self._open_item(kind)
        assert self._open is not None
        index = self._open[1]
        item = self.response["output"][index]
        item["content"][0]["text"] += text
        delta = TEXT_DELTA if kind == "message" else REASONING_DELTA
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(delta, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra))
        return out

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        index = len(self.response["output"])
        item: dict[str, Any]
        if kind == "message":
            item = {"id": self._item_id("msg", index), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": self._item_id("rs", index), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        out = [self._event("response.output_item.added", output_index=index, item=_item_copy(item))]
        item["content"].append(part)
        self.response["output"].append(item)
        self._open = (kind, index)
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part)))
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's end (``status``: completed, or incomplete for a message cut at max_output_tokens)."""
        if self._open is None:
            return []
        kind, index = self._open
        self._open = None
        item = self.response["output"][index]
        item["status"] = status if kind == "message" else "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "message":
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        return [done, self._event("response.content_part.done", **where, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_item_copy(item))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        index = len(self.response["output"])
        fn = call["function"]
        item = {"id": self._item_id("fc", index), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": fn["name"], "arguments": ""}
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item.update(arguments=fn["arguments"], status="completed")
        self.response["output"].append(item)
        self.calls += 1
        where = {"item_id": item["id"], "output_index": index}
        out += [self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"]),
                self._event("response.function_call_arguments.done", **where, name=fn["name"],
                            arguments=fn["arguments"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]
        return out

    # --- the end ----------------------------------------------------------------------------------------
    def _end(self, end: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        out: list[dict[str, Any]] = []
        if self.held and not self.calls:  # whitespace still held: content after all
            out += self._append("message", self.held)
        self.held = ""
        r = self.response
        if "error" in end:
            out += self._close("incomplete")
            r.update(status="failed", error=end["error"])
            return [*out, self._lifecycle("response.failed")]
        status = _STATUS[FinishReason(end["finish"])]
        out += self._close("incomplete" if status == "incomplete" else "completed")
        r.update(status=status, usage=usage(*end["usage"]))  # a step stored before cached tokens were has three
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":  # from the job's own timings: every gateway computes the same
            r["completed_at"] = int(r["created_at"] + end["total_ms"] / 1000)
        return [*out, self._lifecycle(_LIFECYCLE[status])]


def frame(event: dict[str, Any]) -> bytes:
    """One event as a server-sent event. A text delta, most of a stream's events, is written by hand (the bytes
    json writes, at a fraction of its cost: chat's chunks are written so too); any other through json."""
    kind = event["type"]
    if kind in (TEXT_DELTA, REASONING_DELTA):
        return _delta_frame(kind, event["sequence_number"], event["item_id"], event["output_index"],
                            event["content_index"], event["delta"])
    return sse(dumps(event), kind)


def _delta_frame(kind: str, seq: int, item_id: str, output_index: int, content_index: int, delta: str) -> bytes:
    """A text or reasoning delta event's frame, byte for byte as json writes its event (a text delta ends with
    its empty logprobs)."""
    tail = ',"logprobs":[]}' if kind == TEXT_DELTA else "}"
    return (f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{seq},"item_id":{encode_basestring(item_id)},'
            f'"output_index":{output_index},"content_index":{content_index},'
            f'"delta":{encode_basestring(delta)}{tail}\n\n').encode()


def _snapshot(response: dict[str, Any]) -> dict[str, Any]:
    """The response object as it is now, for an event to carry: what later steps change is copied (its output
    items and their content parts, which grow; its fields, which are replaced); what none changes once created
    (instructions, tools, metadata, ...) is shared. A deep copy of every event's response costs more than the
    rest of the event."""
    return {**response, "output": [_item_copy(item) for item in response["output"]]}


def _item_copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in item:
        copied["content"] = [dict(part) for part in item["content"]]
    return copied


def usage(prompt: int, completion: int, reasoning: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached``: the prompt's tokens the worker's prefix cache held."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def replay(created: dict[str, Any], calls_tools: bool, steps: list[Step]) -> ResponseEvents:
    """The response as ``steps`` leave it (its events made and dropped)."""
    events = ResponseEvents(created, calls_tools)
    events.opening()
    for step in steps:
        events.feed(step)
    return events
