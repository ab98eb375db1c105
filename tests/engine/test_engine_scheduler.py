"""The continuous-batching Scheduler, driven step by step over a scripted fake BatchBackend."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from mlxq.engine.core.backend import BatchToken
from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from mlxq.engine.core.scheduler import Scheduler, StepFailed
from tests.engine.fakes import waiting

pytestmark = pytest.mark.unit

# --- fakes ----------------------------------------------------------------------------------------------


class FakeBackend:
    """Records inserts/removes; ``step`` returns the next scripted list of tokens."""

    def __init__(self) -> None:
        self.next_uid = 100  # not 0: uids must not be confused with list positions
        self.inserted: list[dict[str, Any]] = []
        self.removed: list[int] = []
        self.live: set[int] = set()
        self.max_live = 0
        self.script: deque[list[BatchToken]] = deque()
        self.steps = 0
        self.reject: Callable[[list[int]], str | None] = lambda prompt: None  # reason -> ValueError
        self.crash_insert: Callable[[list[int]], bool] = lambda prompt: False  # -> RuntimeError
        self.step_error: Exception | None = None

    def insert(self, prompt: list[int], max_tokens: int, sampler: Any, logits_processors: list[Any]) -> int:
        if self.crash_insert(prompt):
            raise RuntimeError("device lost during insert")
        reason = self.reject(prompt)
        if reason is not None:
            raise ValueError(reason)
        uid = self.next_uid
        self.next_uid += 1
        self.inserted.append(
            {
                "uid": uid,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "sampler": sampler,
                "processors": logits_processors,
            }
        )
        self.live.add(uid)
        self.max_live = max(self.max_live, len(self.live))
        return uid

    def remove(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self.removed.append(uid)
            self.live.discard(uid)

    def step(self) -> list[BatchToken]:
        self.steps += 1
        if self.step_error is not None:
            raise self.step_error
        toks = self.script.popleft() if self.script else []
        for t in toks:
            if t.finish_reason is not None:  # like BatchGenerator: a finished sequence leaves the batch itself
                self.live.discard(t.uid)
        return toks

    def close(self) -> None:
        pass

    def uid(self, n: int) -> int:
        """The uid of the n-th insert."""
        return int(self.inserted[n]["uid"])


def char(token: int) -> str:
    return chr(ord("a") + token % 26)


class FakeDetok:
    """Token id -> one character; ``last_segment`` returns the text since the last read."""

    def __init__(self) -> None:
        self._pending = ""
        self.finalized = False

    def add_token(self, token: int) -> None:
        self._pending += char(token)

    def finalize(self) -> None:
        self.finalized = True

    @property
    def last_segment(self) -> str:
        seg, self._pending = self._pending, ""
        return seg


class LaggyDetok(FakeDetok):
    """Holds back the last character until the next token or ``finalize`` (like a BPE/UTF-8 detokenizer)."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._sent = 0

    def add_token(self, token: int) -> None:
        self._text += char(token)

    def finalize(self) -> None:
        self.finalized = True

    @property
    def last_segment(self) -> str:
        end = len(self._text) if self.finalized else max(self._sent, len(self._text) - 1)
        seg, self._sent = self._text[self._sent : end], end
        return seg


def tok(uid: int, token: int, finish: str | None = None) -> BatchToken:
    return BatchToken(uid, token, finish)


def request(rid: str, n_prompt: int = 3, *, deadline: float | None = None, **params: Any) -> EngineRequest:
    return EngineRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(**params), deadline=deadline)


def by_rid(outs: list[RequestOutput]) -> dict[str, RequestOutput]:
    rids = [o.rid for o in outs]
    assert len(rids) == len(set(rids)), "one output per request per step"
    return {o.rid: o for o in outs}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def detoks() -> list[FakeDetok]:
    return []


def make(
    backend: FakeBackend,
    capacity: int = 4,
    clock: Clock | None = None,
    detok: type = FakeDetok,
    created: list[FakeDetok] | None = None,
    **kw: Any,
) -> Scheduler:
    def new_detok() -> FakeDetok:
        d = detok()
        if created is not None:
            created.append(d)
        return d

    return Scheduler(backend, capacity=capacity, new_detokenizer=new_detok, clock=clock or Clock(), **kw)


# --- admission ------------------------------------------------------------------------------------------


def test_capacity_respected_and_waiting_admitted_as_slots_free(backend: FakeBackend) -> None:
    s = make(backend, capacity=2)
    for rid in ("r0", "r1", "r2", "r3"):
        s.add(request(rid))
    assert s.has_work and len(waiting(s)) == 4

    outs = by_rid(s.step())
    assert set(outs) == {"r0", "r1"}
    assert s.num_running == 2 and len(waiting(s)) == 2
    assert [i["prompt"] for i in backend.inserted] == [[1, 2, 3]] * 2
    assert s.request_ids() == ["r2", "r3", "r0", "r1"]

    # A full batch admits nothing more.
    s.step()
    assert len(backend.inserted) == 2

    # r0 finishes in this step; its slot is given out at the next step.
    u0, u1 = backend.uid(0), backend.uid(1)
    backend.script.append([tok(u0, 4, "length"), tok(u1, 4)])
    outs = by_rid(s.step())
    assert outs["r0"].finish is FinishReason.LENGTH
    assert "r2" not in outs
    assert s.num_running == 1 and len(waiting(s)) == 2

    outs = by_rid(s.step())
    assert outs["r2"].started
    assert "r3" not in outs
    assert s.num_running == 2 and len(waiting(s)) == 1
    assert len(backend.inserted) == 3
    assert backend.max_live <= 2


def test_admission_is_fifo(backend: FakeBackend) -> None:
    s = make(backend, capacity=1)
    for rid, n in (("a", 1), ("b", 2), ("c", 3)):
        s.add(request(rid, n))
    order = []
    for _ in range(3):
        outs = s.step()
        order += [o.rid for o in outs if o.started]
        backend.script.append([tok(backend.uid(len(backend.inserted) - 1), 0, "length")])
        s.step()
    assert order == ["a", "b", "c"]
    assert [len(i["prompt"]) for i in backend.inserted] == [1, 2, 3]


def test_no_backend_step_without_running_requests(backend: FakeBackend) -> None:
    s = make(backend)
    assert s.step() == []
    assert backend.steps == 0
    assert not s.has_work


def test_insert_receives_params_sampler_and_processors(backend: FakeBackend) -> None:
    seen: list[SamplingParams] = []

    def sampler_for(p: SamplingParams) -> str:
        seen.append(p)
        return f"sampler(t={p.temperature})"

    s = make(backend, make_sampler=sampler_for, make_processors=lambda p: ["proc", p.repetition_penalty])
    s.add(request("r", max_tokens=17, temperature=0.5, repetition_penalty=1.2))
    s.step()
    (ins,) = backend.inserted
    assert ins["max_tokens"] == 17
    assert ins["sampler"] == "sampler(t=0.5)"
    assert ins["processors"] == ["proc", 1.2]
    assert seen == [SamplingParams(max_tokens=17, temperature=0.5, repetition_penalty=1.2)]


# --- outputs --------------------------------------------------------------------------------------------


def test_first_output_is_started_with_prompt_tokens(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r", n_prompt=5))
    backend.script.append([tok(backend.next_uid, 0)])  # the first token comes in the admitting step
    (out,) = s.step()
    assert out.rid == "r"
    assert out.started is True
    assert out.prompt_tokens == 5
    assert out.token_ids == [0]
    assert out.finish is None

    backend.script.append([tok(backend.uid(0), 1)])
    (out,) = s.step()
    assert out.started is False
    assert out.prompt_tokens == 0


def test_started_output_without_tokens_yet(backend: FakeBackend) -> None:
    # A long prompt can take several steps of prefill: admission is reported even with no token.
    s = make(backend)
    s.add(request("r", n_prompt=2))
    (out,) = s.step()
    assert (out.started, out.prompt_tokens, out.token_ids, out.text, out.finish) == (True, 2, [], "", None)
    assert s.step() == []  # no token, nothing to report


def test_token_outputs_carry_ids_text_and_counts(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r"))
    s.step()
    u = backend.uid(0)
    texts, counts = [], []
    for t in (7, 4, 11, 11, 14):
        backend.script.append([tok(u, t)])
        (out,) = s.step()
        assert out.token_ids == [t]
        assert out.finish is None
        texts.append(out.text)
        counts.append(out.completion_tokens)
    assert "".join(texts) == "hello"
    assert counts == [1, 2, 3, 4, 5]


def test_tokens_of_several_requests_in_one_step(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("x"))
    s.add(request("y"))
    s.step()
    ux, uy = backend.uid(0), backend.uid(1)
    backend.script.append([tok(uy, 1), tok(ux, 0)])
    outs = by_rid(s.step())
    assert (outs["x"].token_ids, outs["x"].text) == ([0], "a")
    assert (outs["y"].token_ids, outs["y"].text) == ([1], "b")


def test_finish_length(backend: FakeBackend, detoks: list[FakeDetok]) -> None:
    s = make(backend, created=detoks)
    s.add(request("r", max_tokens=2))
    backend.script.append([tok(backend.next_uid, 0)])
    s.step()
    backend.script.append([tok(backend.uid(0), 1, "length")])
    (out,) = s.step()
    assert out.finish is FinishReason.LENGTH
    assert out.token_ids == [1]  # the last token is real text
    assert out.text == "b"
    assert out.completion_tokens == 2
    assert detoks[0].finalized
    assert backend.removed == []  # the backend dropped it itself: no second remove
    assert not s.has_work
    assert s.abort("r") is None


def test_finish_eos_is_stop_and_eos_token_not_emitted(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r"))
    backend.script.append([tok(backend.next_uid, 0)])
    s.step()
    u = backend.uid(0)
    backend.script.append([tok(u, 1)])
    s.step()
    EOS = 25  # would be "z"
    backend.script.append([tok(u, EOS, "stop")])
    (out,) = s.step()
    assert out.finish is FinishReason.STOP
    assert out.token_ids == []
    assert EOS not in out.token_ids
    assert out.text == ""
    assert "z" not in out.text
    assert out.completion_tokens == 2
    assert backend.removed == []
    assert not s.has_work


def test_stop_string_ends_request_and_cuts_text(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r", stop=("cd",)))
    s.add(request("other"))
    s.step()
    u, uo = backend.uid(0), backend.uid(1)
    texts = []
    outs: dict[str, RequestOutput] = {}
    for t in (0, 1, 2, 3):  # a b c d
        backend.script.append([tok(u, t), tok(uo, 4)])
        outs = by_rid(s.step())
        texts.append(outs["r"].text)
    assert texts == ["a", "b", "", ""]  # "c" held back, then dropped with the stop string
    assert outs["r"].finish is FinishReason.STOP
    assert outs["r"].completion_tokens == 4
    assert backend.removed == [u]
    assert s.num_running == 1
    assert s.request_ids() == ["other"]
    assert outs["other"].finish is None


def test_stop_string_within_one_segment(backend: FakeBackend) -> None:
    s = make(backend, detok=LaggyDetok)
    s.add(request("r", stop=("bc",)))
    s.step()
    u = backend.uid(0)
    backend.script.append([tok(u, 0)])
    backend.script.append([tok(u, 1)])
    backend.script.append([tok(u, 2)])
    backend.script.append([tok(u, 3)])  # the segment "c" completes the stop string here
    text = ""
    out = None
    for _ in range(4):
        (out,) = s.step()
        text += out.text
    assert out is not None and out.finish is FinishReason.STOP
    assert text == "a"
    assert backend.removed == [u]


def test_held_prefix_released_when_length_ends_sequence(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r", stop=("cx",)))
    s.step()
    u = backend.uid(0)
    backend.script.append([tok(u, 0)])
    backend.script.append([tok(u, 2, "length")])  # "c" could start "cx", but the sequence ends
    (o1,) = s.step()
    (o2,) = s.step()
    assert o1.text + o2.text == "ac"
    assert o2.finish is FinishReason.LENGTH


def test_detokenizer_tail_flushed_on_finish(backend: FakeBackend) -> None:
    s = make(backend, detok=LaggyDetok)
    s.add(request("r"))
    s.step()
    u = backend.uid(0)
    backend.script.append([tok(u, 7)])
    backend.script.append([tok(u, 8)])
    backend.script.append([tok(u, 25, "stop")])  # EOS: finalize releases the held "i"
    text = "".join(s.step()[0].text for _ in range(3))
    assert text == "hi"


def test_stop_string_completed_by_detokenizer_tail_is_stop(backend: FakeBackend) -> None:
    s = make(backend, detok=LaggyDetok)
    s.add(request("r", stop=("bc",)))
    s.step()
    u = backend.uid(0)
    for t, fin in ((0, None), (1, None), (2, "length")):
        backend.script.append([tok(u, t, fin)])
    outs = [s.step()[0] for _ in range(3)]
    assert "".join(o.text for o in outs) == "a"
    assert outs[-1].finish is FinishReason.STOP  # the stop string, not the length limit, ended it


# --- abort ----------------------------------------------------------------------------------------------


def test_abort_waiting_request(backend: FakeBackend) -> None:
    s = make(backend, capacity=1)
    s.add(request("run"))
    s.add(request("wait"))
    s.step()
    out = s.abort("wait")
    assert out is not None
    assert (out.rid, out.finish, out.error_code) == ("wait", FinishReason.CANCELLED, None)
    assert out.completion_tokens == 0
    assert backend.removed == []
    assert len(waiting(s)) == 0
    # It is never admitted afterwards.
    backend.script.append([tok(backend.uid(0), 0, "length")])
    s.step()
    s.step()
    assert len(backend.inserted) == 1


def test_abort_running_request(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r"))
    s.add(request("keep"))
    s.step()
    u, uk = backend.uid(0), backend.uid(1)
    backend.script.append([tok(u, 0), tok(uk, 0)])
    backend.script.append([tok(u, 1), tok(uk, 1)])
    s.step()
    s.step()
    out = s.abort("r")
    assert out is not None
    assert out.finish is FinishReason.CANCELLED
    assert out.completion_tokens == 2
    assert backend.removed == [u]
    assert s.request_ids() == ["keep"]
    assert s.abort("r") is None  # already gone


def test_abort_unknown_id_returns_none(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r"))
    assert s.abort("nope") is None
    assert len(waiting(s)) == 1
    assert backend.removed == []


def test_abort_with_custom_reason(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r"))
    s.step()
    out = s.abort("r", FinishReason.ERROR, "engine_error", "oops")
    assert out is not None
    assert (out.finish, out.error_code, out.error_message) == (FinishReason.ERROR, "engine_error", "oops")


# --- deadlines ------------------------------------------------------------------------------------------


def test_deadline_expiry_of_running_request(backend: FakeBackend, clock: Clock) -> None:
    s = make(backend, clock=clock)
    s.add(request("r", deadline=clock.now + 10))
    s.add(request("nodeadline"))
    s.step()
    u, un = backend.uid(0), backend.uid(1)
    backend.script.append([tok(u, 0), tok(un, 0)])
    clock.now += 5
    assert by_rid(s.step())["r"].finish is None

    clock.now += 6  # past the deadline
    backend.script.append([tok(u, 1), tok(un, 1)])  # a token the backend still made is ignored
    outs = by_rid(s.step())
    out = outs["r"]
    assert out.finish is FinishReason.ERROR
    assert out.error_code == "timeout"
    assert out.error_message
    assert out.token_ids == []
    assert out.completion_tokens == 1
    assert backend.removed == [u]
    assert s.request_ids() == ["nodeadline"]
    assert outs["nodeadline"].token_ids == [1]


def test_deadline_expiry_of_waiting_request(backend: FakeBackend, clock: Clock) -> None:
    s = make(backend, capacity=1, clock=clock)
    s.add(request("run"))
    s.add(request("wait", deadline=clock.now + 1))
    s.step()
    clock.now += 2
    outs = by_rid(s.step())
    assert outs["wait"].finish is FinishReason.ERROR
    assert outs["wait"].error_code == "timeout"
    assert backend.removed == []
    assert len(backend.inserted) == 1
    assert len(waiting(s)) == 0


def test_expired_before_admission_is_never_inserted(backend: FakeBackend, clock: Clock) -> None:
    s = make(backend, clock=clock)
    s.add(request("r", deadline=clock.now - 1))
    (out,) = s.step()
    assert out.error_code == "timeout"
    assert not out.started
    assert backend.inserted == []


# --- failures -------------------------------------------------------------------------------------------


def test_insert_value_error_is_bad_request(backend: FakeBackend) -> None:
    backend.reject = lambda prompt: "prompt too long" if len(prompt) > 4 else None
    s = make(backend, capacity=2)
    s.add(request("big", n_prompt=10))
    s.add(request("ok", n_prompt=2))
    outs = by_rid(s.step())
    assert outs["big"].finish is FinishReason.ERROR
    assert outs["big"].error_code == "bad_request"
    assert outs["big"].error_message == "prompt too long"
    assert not outs["big"].started
    assert outs["ok"].started  # the next waiting request still gets the slot
    assert s.request_ids() == ["ok"]


def test_fail_all_fails_everything_and_clears_state(backend: FakeBackend) -> None:
    s = make(backend, capacity=1)
    s.add(request("run"))
    s.add(request("wait"))
    s.step()
    backend.script.append([tok(backend.uid(0), 0)])
    s.step()
    outs = by_rid(s.fail_all("engine_error", "metal died"))
    assert set(outs) == {"run", "wait"}
    for out in outs.values():
        assert out.finish is FinishReason.ERROR
        assert (out.error_code, out.error_message) == ("engine_error", "metal died")
    assert outs["run"].completion_tokens == 1
    assert not s.has_work
    assert s.num_running == 0 and len(waiting(s)) == 0
    assert s.request_ids() == []
    assert s.abort("run") is None and s.abort("wait") is None
    steps = backend.steps
    assert s.step() == []
    assert backend.steps == steps


def test_scheduler_usable_after_fail_all(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("old"))
    s.step()
    s.fail_all("engine_error", "x")
    s.add(request("new"))
    (out,) = s.step()
    assert out.rid == "new" and out.started


# --- stale tokens ---------------------------------------------------------------------------------------


def test_tokens_for_aborted_uid_are_ignored(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("gone"))
    s.add(request("here"))
    s.step()
    ug, uh = backend.uid(0), backend.uid(1)
    s.abort("gone")
    backend.script.append([tok(ug, 0), tok(uh, 1), tok(999, 2)])
    outs = by_rid(s.step())
    assert set(outs) == {"here"}
    assert outs["here"].token_ids == [1]


def test_tokens_after_finish_in_same_step_are_ignored(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("r", stop=("b",)))
    s.step()
    u = backend.uid(0)
    # The first token ends the request (stop string); a later token for the same uid in this step
    # belongs to a sequence already removed.
    backend.script.append([tok(u, 0), tok(u, 1), tok(u, 2)])
    (out,) = s.step()
    assert out.finish is FinishReason.STOP
    assert out.text == "a"
    assert out.token_ids == [0, 1]
    assert out.completion_tokens == 2
    assert backend.removed == [u]
    assert not s.has_work


# --- a step that raises -----------------------------------------------------------------------------------


def run_step_like_engine(s: Scheduler) -> list[RequestOutput]:
    """What ``Engine._tick`` does: the step's outputs, or on an exception, ``fail_all``'s."""
    try:
        return s.step()
    except StepFailed as exc:  # what engine.Engine does: the step's outputs first, then fail the rest
        return exc.outputs + s.fail_all("engine_error", f"engine step failed: {exc.__cause__!r}")
    except Exception as exc:
        return s.fail_all("engine_error", f"engine step failed: {exc!r}")


def test_failing_backend_step_fails_running_requests(backend: FakeBackend) -> None:
    s = make(backend)
    s.add(request("a"))
    s.add(request("b"))
    s.step()
    backend.step_error = RuntimeError("metal")
    outs = by_rid(run_step_like_engine(s))
    assert set(outs) == {"a", "b"}
    assert all(o.finish is FinishReason.ERROR and o.error_code == "engine_error" for o in outs.values())
    assert not s.has_work


def last_outputs(outs: list[RequestOutput]) -> dict[str, RequestOutput]:
    """The engine may emit a request twice in a failed step (its start, then its error): keep the last."""
    return {o.rid: o for o in outs}


def test_expired_request_gets_terminal_output_when_backend_step_fails(backend: FakeBackend, clock: Clock) -> None:
    s = make(backend, clock=clock)
    s.add(request("late", deadline=clock.now + 1))
    s.add(request("other"))
    s.step()
    clock.now += 2
    backend.step_error = RuntimeError("metal")
    outs = last_outputs(run_step_like_engine(s))
    assert set(outs) == {"late", "other"}
    assert all(o.finish is FinishReason.ERROR for o in outs.values())


def test_request_whose_insert_crashes_gets_terminal_output(backend: FakeBackend) -> None:
    backend.crash_insert = lambda prompt: len(prompt) == 7
    s = make(backend)
    s.add(request("ok"))
    s.add(request("crash", n_prompt=7))
    s.add(request("after"))
    outs = last_outputs(run_step_like_engine(s))
    assert set(outs) == {"ok", "crash", "after"}
    assert all(o.finish is FinishReason.ERROR for o in outs.values())


def test_coalesce_merges_steps_per_request_in_order() -> None:
    from mlxq.engine.core.request import coalesce

    outs = [
        RequestOutput("a", [1], "x", started=True, prompt_tokens=3, completion_tokens=1),
        RequestOutput("b", [7], "q", started=True, prompt_tokens=2, completion_tokens=1),
        RequestOutput("a", [2, 3], "yz", completion_tokens=3),
        RequestOutput("a", [], "", completion_tokens=3, finish=FinishReason.LENGTH),
    ]
    merged = coalesce(outs)
    assert [m.rid for m in merged] == ["a", "b"]
    a = merged[0]
    assert (a.token_ids, a.text, a.started, a.prompt_tokens, a.completion_tokens, a.finish) == (
        [1, 2, 3], "xyz", True, 3, 3, FinishReason.LENGTH)
    assert outs[0].token_ids == [1]  # inputs untouched


def test_coalesce_keeps_the_cached_prompt_tokens_its_start_reported() -> None:
    from mlxq.engine.core.request import coalesce

    outs = [RequestOutput("a", [1], "x", started=True, prompt_tokens=90, completion_tokens=1, cached_tokens=64),
            RequestOutput("a", [2], "y", completion_tokens=2), RequestOutput("b", [3], "z", completion_tokens=1)]
    for merged in (coalesce(outs)[0], coalesce(outs[1:2] + outs[:1])[0]):  # a start merged first or into another
        assert (merged.started, merged.prompt_tokens, merged.cached_tokens) == (True, 90, 64)


def test_coalesce_hands_back_one_output_per_request_as_it_is() -> None:
    from mlxq.engine.core.request import coalesce

    outs = [RequestOutput("a", [1], "x", completion_tokens=1), RequestOutput("b", [2], "y", completion_tokens=4)]
    merged = coalesce(outs)
    assert merged == outs and all(m is o for m, o in zip(merged, outs)) and merged is not outs


def test_coalesce_drops_outputs_after_a_requests_end() -> None:
    from mlxq.engine.core.request import coalesce

    outs = [
        RequestOutput("a", [1], "x", completion_tokens=1),
        RequestOutput("a", finish=FinishReason.CANCELLED),
        RequestOutput("a", [2], "y", completion_tokens=2),  # the step in flight when the cancel landed
        RequestOutput("a", finish=FinishReason.CANCELLED),  # the engine's own terminal output
    ]
    (a,) = coalesce(outs)
    assert (a.token_ids, a.text, a.finish) == ([1], "x", FinishReason.CANCELLED)
