"""Fuzzing bad input end to end: the worker's payload validation, the client API, and the real worker.

Every malformed job must get a clear error (``BadRequest`` in the worker, which becomes one terminal
``error(bad_request)`` event; ``api.errors.BadRequest`` in the client, with nothing enqueued), the worker
must keep serving, and well-formed jobs running beside the bad ones must be unaffected.

The tests at the end of the file pin gaps the fuzzing found (now fixed).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest as ClientBadRequest
from mlxq.api.protocol.jobrecord import JOB_FUNCTION, job_record, read_job
from mlxq.api.schema import (
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_CEILING,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
)
from mlxq.worker.config import WorkerConfig
from mlxq.worker.jobs import prompt as prompt_stage
from mlxq.worker.jobs.model import ModelView
from mlxq.worker.jobs.prepare import BadRequest, validate
from mlxq.worker.jobs.prompt import Prompt, PromptError, encode
from mlxq.worker.jobs.translate import to_engine_request
from tests.support import RunningWorker, collect, enqueue_raw, start_worker, terminal, text_of

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "tiny"
QUEUE = f"mlxq:queue:{MODEL}"
JOB_ID = "fuzz-job-0001"  # the id mutated payloads carry (the end-to-end test swaps in a fresh one per job)
GOOD = {"id": JOB_ID, "model": MODEL, "prompt": "hi", "max_tokens": 4}  # an ordinary job
FIELDS = ("id", "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "seed", "stop", "metadata")
ROLES = ("system", "user", "assistant", "tool")
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))


# --- strategies ------------------------------------------------------------------------------------
ANY_CHAR = st.characters(exclude_categories=[])  # includes lone surrogates ("Cs") and "\x00"


def any_text(max_size: int = 12) -> st.SearchStrategy[str]:
    return st.text(ANY_CHAR, max_size=max_size)


EDGE_STRINGS = st.sampled_from(
    ["", " ", "\x00", "\ud800", "\udfff", "a\ud83d", "\ufeff", "tiny", "TINY", "tiny\x00", "<|im_end|>",
     "<|im_start|>user\n", "{{ 7 * 7 }}", "{% for x in y %}", "user", "0", "1e9", "NaN", "-1", "true"]
)
EDGE_INTS = st.sampled_from(
    [0, -1, 1, 2, 255, 511, 512, 513, 8192, 8193, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 10**100,
     -(10**100), MAX_TOKENS_CEILING, MAX_TOKENS_CEILING + 1]
)
EDGE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-320, 1e308, -1e308, 0.5, 1.0, 1.0001,
                               100.0, 100.5])
HUGE_UNITS = st.sampled_from(["a", "ab ", "\x00", "é", "\U0001f600", "\ud800", "<|im_end|>"])


def huge_strings(sizes: list[int]) -> st.SearchStrategy[str]:
    """Long strings, cheaply: a short unit repeated (sizes are repeat counts)."""
    return st.builds(lambda unit, n: unit * n, HUGE_UNITS, st.sampled_from(sizes))


# Repeat counts: > MAX_PROMPT_CHARS is refused by the schema, the others are tokenized (kept cheap).
BIG = [257, 1000, 5000, MAX_PROMPT_CHARS + 1, 2_000_000]
MEDIUM = [257, 1000, 5000, MAX_PROMPT_CHARS + 1]
SMALL = [257, 5000, 50_000]  # end to end: every payload also crosses Redis (twice: arq stores results with args)


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), EDGE_INTS, st.floats(), EDGE_FLOATS, any_text(),
                    EDGE_STRINGS)
# Arbitrary JSON-ish values (nan/inf and lone surrogates included: arq's JSON round-trips them).
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text(8) | EDGE_STRINGS, inner, max_size=4),
    max_leaves=8,
)


def json_values(sizes: list[int]) -> st.SearchStrategy[Any]:
    """JSON values, sometimes a huge string."""
    return st.one_of(JSON_VALUES, JSON_VALUES, JSON_VALUES, huge_strings(sizes))


def messages_values(sizes: list[int]) -> st.SearchStrategy[Any]:
    """Chat lists: empty, oversized (> MAX_MESSAGES), bad roles, wrong types, huge contents."""
    role = st.sampled_from(ROLES) | EDGE_STRINGS | SCALARS
    content = st.text(max_size=20) | EDGE_STRINGS | SCALARS
    message = st.fixed_dictionaries(
        {"role": role, "content": content},
        optional={"name": any_text(), "tool_calls": JSON_VALUES, "bogus": st.integers()},
    )
    short = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=10)})
    return st.one_of(
        st.lists(message, max_size=3),
        st.builds(lambda m, n: [m] * n, short, st.sampled_from([0, 1, MAX_MESSAGES, MAX_MESSAGES + 1])),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": huge_strings(sizes)}),
                 min_size=1, max_size=2),
        st.lists(JSON_VALUES, max_size=3),
    )


STOP_LISTS = st.one_of(
    st.lists(any_text(4), max_size=20),
    # 0..100 copies of one string of 0..1000 chars
    st.builds(lambda unit, length, n: [unit * length] * n, HUGE_UNITS, st.integers(0, 1000), st.integers(0, 100)),
    st.lists(st.text(min_size=1, max_size=4), min_size=MAX_STOP_STRINGS, max_size=MAX_STOP_STRINGS + 1),
    st.lists(SCALARS, max_size=3),
)


def field_values(sizes: list[int]) -> st.SearchStrategy[Any]:
    return st.one_of(JSON_VALUES, EDGE_INTS, EDGE_FLOATS, EDGE_STRINGS, huge_strings(sizes), STOP_LISTS,
                     messages_values(sizes))


def valid_fields(max_tokens: int = 64, always_max_tokens: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments of a request the schema accepts (and the tiny worker, within its limits)."""
    chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=40)}),
                    min_size=1, max_size=4)
    prompt_kind = st.one_of(
        st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=60)}),
        st.fixed_dictionaries({"messages": chat}),
    )
    limit = {"max_tokens": st.integers(1, max_tokens)}
    optional = st.fixed_dictionaries(limit if always_max_tokens else {}, optional={
        **({} if always_max_tokens else limit),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 50),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.none() | st.floats(0.5, 2),
        "seed": st.none() | st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3),
    })
    return st.builds(lambda kind, opt: {"model": MODEL, **kind, **opt}, prompt_kind, optional)


@st.composite
def mutated(draw: st.DrawFn, sizes: list[int], with_id: bool = True, max_tokens: int = 64,
            always_max_tokens: bool = False) -> dict[str, Any]:
    """A valid request with 0..3 mutations: a field set to a wrong-typed/out-of-range value, deleted, or an
    unknown field added."""
    payload = draw(valid_fields(max_tokens, always_max_tokens))
    if with_id:
        payload = {"id": JOB_ID, **payload}
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["set", "set", "del", "extra", "limits"]))
        if kind == "limits":  # near the worker's limits: max_tokens vs context, prompt tokens
            payload["max_tokens"] = draw(st.integers(200, 600) | EDGE_INTS)
            if draw(st.booleans()):
                payload.pop("messages", None)
                payload["prompt"] = draw(st.builds(lambda unit, n: unit * n, st.sampled_from(["ab ", "x", "7"]),
                                                   st.integers(1, 2000)))
        elif kind == "set":
            payload[draw(st.sampled_from(FIELDS))] = draw(field_values(sizes))
        elif kind == "del":
            payload.pop(draw(st.sampled_from(FIELDS)), None)
        else:
            payload[draw(any_text(16) | EDGE_STRINGS | huge_strings([300]))] = draw(JSON_VALUES)
    return payload


def e2e_payloads(sizes: list[int]) -> st.SearchStrategy[Any]:
    short = mutated(sizes, max_tokens=24, always_max_tokens=True)  # valid ones run: keep them short
    return st.one_of(short, short, short, json_values(sizes))


# --- the worker's validation, in process -------------------------------------------------------------
def wire(payload: Any) -> Any:
    """``payload`` as the worker receives it: through the JSON job record."""
    return read_job(job_record(payload, 0), 1 << 40).payload


@dataclass
class Validator:
    """The worker's real validation of a job (worker/jobs/prepare.py's ``validate``, worker/jobs/prompt.py's
    ``encode``) around the real tiny model."""

    model: ModelView
    vocab: int

    @property
    def config(self) -> WorkerConfig:
        return self.model.config

    def check(self, payload: Any, job_id: str) -> tuple[GenerateRequest, list[int]] | str:
        """The accepted request and its tokens, or the BadRequest message; asserts the contract."""
        try:
            req = validate(payload, job_id, self.model)
            encoded = encode(req, self.model, inline=True)
            tokens = encoded.tokens
        except (BadRequest, PromptError) as exc:
            message = str(exc)
            assert message.strip(), "BadRequest without a message"
            # The message must be publishable as an event (JSON, valid UTF-8).
            ErrorEvent(id=job_id, seq=0, code=ErrorCode.BAD_REQUEST, message=message).model_dump_json()
            return message
        self.assert_within_limits(req, tokens, job_id)
        assert 0 <= encoded.cache_boundary < len(tokens)  # a system-prompt prefix, never the whole prompt
        assert encoded.cache_boundary == 0 or (req.messages is not None and req.messages[0].role == "system")
        try:  # the direct Rust call (inline) and transformers (long prompts, off the loop) agree
            assert encode(req, self.model, inline=False) == encoded
        except PromptError as exc:
            raise AssertionError(f"only the inline tokenizer accepted the prompt: {exc}") from exc
        return req, tokens

    def assert_within_limits(self, req: GenerateRequest, tokens: list[int], job_id: str) -> None:
        cfg = self.config
        ctx = self.model.context_length
        assert isinstance(req, GenerateRequest)
        assert req.id == job_id
        assert req.model in (cfg.model, cfg.model_name)
        assert (req.prompt is None) != (req.messages is None)
        assert 1 <= req.max_tokens <= cfg.max_tokens_limit
        limit = min(cfg.max_prompt_tokens, ctx or cfg.max_prompt_tokens)
        assert 1 <= len(tokens) <= limit
        assert ctx is None or len(tokens) + req.max_tokens <= ctx
        assert all(isinstance(t, int) and 0 <= t < self.vocab for t in tokens)
        assert len(req.stop) <= getattr(cfg, "max_stop_strings", MAX_STOP_STRINGS)
        assert all(0 < len(s) <= getattr(cfg, "max_stop_chars", MAX_STOP_CHARS) for s in req.stop)
        assert req.prompt is None or len(req.prompt) <= MAX_PROMPT_CHARS
        assert req.messages is None or 1 <= len(req.messages) <= MAX_MESSAGES
        assert math.isfinite(req.temperature) and math.isfinite(req.top_p) and math.isfinite(req.min_p)
        # What the worker accepted re-encodes (no lone surrogates) and converts to an engine request.
        assert GenerateRequest.model_validate_json(req.model_dump_json()) == req
        to_engine_request(req, Prompt(tokens, req.max_tokens), None)


@pytest.fixture(scope="module")
def validator(tiny_model: Path) -> Validator:
    from mlxq.engine.mlx.loader import load_model

    config = WorkerConfig(model=str(tiny_model), model_name=MODEL, redis_url="redis://127.0.0.1:1")
    model = ModelView.of(config.served[0], config, load_model(str(tiny_model)))
    vocab = max(model.tokenizer.get_vocab().values()) + 1
    return Validator(model, vocab)


@settings(FUZZ, max_examples=1000)
@given(payload=mutated(BIG), other_id=st.booleans())
@example(payload={"id": JOB_ID, "model": MODEL, "messages": []}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "a" * MAX_PROMPT_CHARS}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "\x00"}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "hi \ud800"}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "hi", "stop": ["x" * 1000] * 100}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "hi", "max_tokens": 10**30}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "hi", "temperature": math.nan}, other_id=False)
@example(payload={"id": JOB_ID, "model": MODEL, "prompt": "hi"}, other_id=True)
def test_worker_validation_of_mutated_payloads(validator: Validator, payload: dict[str, Any], other_id: bool) -> None:
    outcome = validator.check(wire(payload), "another-job" if other_id else JOB_ID)
    if isinstance(outcome, str):  # refused: the job ends error(bad_request) with this message
        assert outcome.strip()
        ErrorEvent(id=JOB_ID, seq=0, code=ErrorCode.BAD_REQUEST, message=outcome)  # publishable as one
        event(f"refused: {re.sub(r'[0-9(:].*', '', outcome)}")
    else:  # accepted: a request within every limit, and its prompt's tokens
        req, tokens = outcome
        assert isinstance(req, GenerateRequest) and req.id == JOB_ID and tokens
        event("accepted")
    served = validator.check(GOOD, JOB_ID)  # the worker serves on: the next ordinary job is accepted
    assert not isinstance(served, str), served


@settings(FUZZ, max_examples=300)
@given(payload=json_values(BIG))
@example(payload="not a dict")
@example(payload=None)
@example(payload=[{"id": JOB_ID, "model": MODEL, "prompt": "hi"}])
def test_worker_validation_of_arbitrary_json(validator: Validator, payload: Any) -> None:
    outcome = validator.check(wire(payload), JOB_ID)
    assert isinstance(outcome, str), "an arbitrary value was accepted as a request"


@settings(FUZZ, max_examples=100)
@given(fields=valid_fields(max_tokens=400))
def test_worker_accepts_valid_requests_that_fit(validator: Validator, fields: dict[str, Any]) -> None:
    req = GenerateRequest(id=JOB_ID, **fields)
    outcome = validator.check(req.model_dump(mode="json"), JOB_ID)
    if isinstance(outcome, str):  # only the model's context may refuse a schema-valid short request
        assert "exceeds the context" in outcome, outcome


# --- the client API --------------------------------------------------------------------------------
@dataclass
class RecordingPool:
    """Stands in for the enqueuer's Redis connection: records the enqueues it would send."""

    calls: list[tuple[str, Any, str, str]] = field(default_factory=list)

    async def exchange(self, commands: list[tuple[Any, ...]]) -> list[int]:
        """The client enqueues through one Lua script (EVALSHA sha numkeys keys... args...): record what it
        would store."""
        for _, _sha, numkeys, *keys_and_args in commands:
            keys, args = keys_and_args[:numkeys], keys_and_args[numkeys:]
            job_id, job = args[0], json.loads(args[1])
            self.calls.append((job["f"], job["a"][0], job_id, keys[2]))
        return [1] * len(commands)


@dataclass
class OfflineClient:
    client: Client
    pool: RecordingPool
    loop: asyncio.AbstractEventLoop

    def submit(self, fields: dict[str, Any]) -> str:
        self.pool.calls.clear()
        return self.loop.run_until_complete(self.client.submit(**fields))


@pytest.fixture(scope="module")
def offline_client() -> Iterator[OfflineClient]:
    pool = RecordingPool()
    loop = asyncio.new_event_loop()
    client = Client("redis://127.0.0.1:1")  # never connects: the enqueuer's sends are recorded
    client._enqueuer._exchange = pool.exchange  # type: ignore[method-assign]
    yield OfflineClient(client, pool, loop)
    loop.run_until_complete(client.aclose())
    loop.close()


def client_fields(sizes: list[int]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.sampled_from(FIELDS) | any_text(10) | EDGE_STRINGS
    return st.one_of(
        mutated(sizes, with_id=False),
        mutated(sizes, with_id=False),
        valid_fields(),
        st.dictionaries(names, field_values(sizes), max_size=6),
    )


def expected_request(fields: dict[str, Any]) -> GenerateRequest | None:
    try:
        return GenerateRequest(**fields)
    except (ValidationError, TypeError):
        return None


@settings(FUZZ, max_examples=1000)
@given(fields=client_fields(BIG))
@example(fields={"model": MODEL, "messages": []})
@example(fields={"model": MODEL, "prompt": "hi", "stop": ["x" * 1000] * 100})
@example(fields={"model": MODEL, "prompt": "\ud800"})
@example(fields={"model": MODEL, "prompt": "hi", "request": {}})
@example(fields={"model": MODEL, "prompt": "hi", "id": "../../etc"})
def test_client_submit_refuses_invalid_fields_and_enqueues_valid_ones(
    offline_client: OfflineClient, validator: Validator, fields: dict[str, Any]
) -> None:
    expected = expected_request(fields)
    try:
        rid = offline_client.submit(fields)
    except ClientBadRequest as exc:
        assert expected is None, f"the client refused a valid request: {exc}"
        assert str(exc).strip()
        assert offline_client.pool.calls == []
        return
    assert expected is not None, "the client enqueued an invalid request"
    ((function, payload, job_id, queue),) = offline_client.pool.calls
    assert (function, job_id, queue) == (JOB_FUNCTION, rid, f"mlxq:queue:{expected.model}")
    if "id" in fields:
        assert rid == fields["id"]
    sent = GenerateRequest.model_validate(wire(payload))
    assert sent.id == rid
    assert sent.model_dump(exclude={"id"}) == expected.model_dump(exclude={"id"})
    # The worker's schema agrees with the client's: only its deployment limits may still refuse the job.
    outcome = validator.check(wire(payload), rid)
    if isinstance(outcome, str):
        assert not outcome.startswith("invalid request"), outcome


@pytest.fixture(scope="module")
def fuzz_redis(redis_server: Any) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.flushall()
    r.close()


@settings(FUZZ, max_examples=100)
@given(fields=client_fields(MEDIUM))
@example(fields={"model": MODEL, "prompt": ""})
@example(fields={"model": MODEL, "prompt": "x", "max_tokens": 0})
def test_real_client_enqueues_nothing_for_invalid_requests(
    redis_server: Any, fuzz_redis: redis.Redis, fields: dict[str, Any]
) -> None:
    fuzz_redis.flushall()
    expected = expected_request(fields)

    async def submit() -> str:
        async with Client(redis_server.url) as client:
            return await client.submit(**fields)

    try:
        rid = asyncio.run(submit())
    except ClientBadRequest:
        assert expected is None
        assert fuzz_redis.dbsize() == 0, "an invalid request left something in Redis"
        return
    assert expected is not None
    raw = fuzz_redis.get(f"mlxq:{{{rid}}}:job")
    assert raw is not None
    assert fuzz_redis.zscore(f"mlxq:queue:{expected.model}", rid) is not None
    sent = GenerateRequest.model_validate(read_job(raw, 1 << 40).payload)
    assert sent.model_dump(exclude={"id"}) == expected.model_dump(exclude={"id"})


# --- end to end: fuzzed jobs through a real worker, beside well-formed ones --------------------------
CONTROLS = [("Once upon a time", 24), ("the quick brown fox jumps over the lazy dog", 32), ("Hello world", 16)]
_control_text: dict[str, str] = {}  # greedy text of each control job run alone (computed once)


def same_message(a: str, b: str) -> bool:
    """Equal up to a default (random) request id the schema made up for a payload without one."""
    generated = re.compile(r"^request id '[0-9a-f]{32}' does not match")
    return generated.sub("request id ? does not match", a) == generated.sub("request id ? does not match", b)


def e2e_config(url: str, tiny_model: Path) -> WorkerConfig:
    return WorkerConfig(model=str(tiny_model), model_name=MODEL, redis_url=url, capacity=8,
                        poll_delay_s=0.25, cancel_poll_s=0.1, drain_timeout_s=5.0)


async def run_batch(config: WorkerConfig, validator: Validator, batch: list[Any]) -> None:
    running = await start_worker(config)
    client = Client(config.redis_url)
    try:
        for prompt, max_tokens in CONTROLS:  # each control alone, once per module
            if prompt not in _control_text:
                alone = await client.generate(model=MODEL, prompt=prompt, max_tokens=max_tokens, timeout=60)
                _control_text[prompt] = alone.text

        jobs: list[tuple[str, Any]] = []  # (rid, payload as sent) in enqueue order
        controls: dict[str, str] = {}  # rid -> prompt
        step = max(1, len(batch) // len(CONTROLS))
        for i, payload in enumerate(batch):
            if i % step == 0 and len(controls) < len(CONTROLS):
                prompt, max_tokens = CONTROLS[len(controls)]
                controls[await client.submit(model=MODEL, prompt=prompt, max_tokens=max_tokens)] = prompt
            rid = f"fz{i:03d}-{uuid.uuid4().hex[:12]}"
            if isinstance(payload, dict) and payload.get("id") == JOB_ID:
                payload = {**payload, "id": rid}
            await enqueue_raw(config.redis_url, payload, rid, MODEL)
            jobs.append((rid, payload))

        results = await asyncio.gather(*(collect(client, rid) for rid, _ in jobs),
                                       *(collect(client, rid) for rid in controls))
        for (rid, payload), events in zip(jobs, results):
            end = terminal(events)
            outcome = validator.check(wire(payload), rid)
            if isinstance(outcome, str):
                assert isinstance(end, ErrorEvent), (payload, end)
                assert end.code is ErrorCode.BAD_REQUEST and not end.retryable
                assert same_message(end.message, outcome)
                assert [e.type for e in events] == ["error"]
            else:
                assert isinstance(end, DoneEvent), (payload, end)
                assert end.usage.prompt_tokens == len(outcome[1])
                assert end.usage.completion_tokens <= outcome[0].max_tokens
        for rid, events in zip(controls, results[len(jobs):]):
            assert isinstance(terminal(events), DoneEvent)
            assert text_of(events) == _control_text[controls[rid]], "a bad job changed a concurrent good one"

        assert not running.task.done(), "the arq worker stopped"
        ok = await client.generate(model=MODEL, prompt="still alive", max_tokens=4, timeout=60)
        assert ok.usage.completion_tokens == 4
    finally:
        await client.aclose()
        await running.close()


@settings(FUZZ, max_examples=4)
@given(batch=st.lists(e2e_payloads(SMALL), min_size=20, max_size=20))
def test_fuzzed_jobs_end_with_one_terminal_event_and_leave_others_alone(
    redis_server: Any, fuzz_redis: redis.Redis, tiny_model: Path, validator: Validator, batch: list[Any]
) -> None:
    fuzz_redis.flushall()
    asyncio.run(run_batch(e2e_config(redis_server.url, tiny_model), validator, batch))


# --- job records that are not even well-formed JSON jobs ---------------------------------------------
# Written straight into Redis as a job record, as a producer other than ``Client`` might.
UNDECODABLE = {
    "invalid_utf8": b"\xff\xfe\xfd garbage",
    "invalid_utf8_in_json": b'{"f":"generate","a":[{"model":"tiny","prompt":"\xff\xfe"}],"k":{},"t":1,"et":0}',
    "not_json": b"not json at all",
    "json_not_an_object": b"[1,2,3]",
    "missing_keys": b'{"f":"generate"}',
    "no_arguments": b'{"f":"generate","a":[],"k":{},"t":1,"et":0}',
    "extra_kwargs": b'{"f":"generate","a":[{}],"k":{"x":1},"t":1,"et":0}',
    "unknown_function": b'{"f":"nope","a":[{}],"k":{},"t":1,"et":0}',
}
# Well-formed JSON whose envelope fields have the wrong types (arq's own run_job raised outside its try).
POISON = {
    "enqueue_time_not_a_number": b'{"f":"generate","a":[{}],"k":{},"t":1,"et":"soon"}',
    "try_not_a_number": b'{"f":"generate","a":[{}],"k":{},"t":"1","et":0}',
    "function_not_a_string": b'{"f":["generate"],"a":[{}],"k":{},"t":1,"et":0}',
}


async def put_raw_job(r: aredis.Redis, raw: bytes) -> str:
    rid = uuid.uuid4().hex
    await r.set(f"mlxq:{{{rid}}}:job", raw, px=60_000)
    await r.zadd(QUEUE, {rid: int(time.time() * 1000)})
    return rid


async def wait_picked_up(r: aredis.Redis, rid: str, timeout: float = 10) -> None:
    """Until a worker took the job: it left the queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await r.zscore(QUEUE, rid) is None:
            await asyncio.sleep(0.2)  # a few poll cycles for arq to act on it
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"arq never picked up job {rid}")


async def test_undecodable_jobs_do_not_stop_the_worker(worker: RunningWorker, client: Client,
                                                       redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        good = await client.submit(model=MODEL, prompt="Hello world", max_tokens=16)
        rids = [await put_raw_job(r, raw) for raw in UNDECODABLE.values()]
        for rid in rids:
            await wait_picked_up(r, rid)
            assert await r.exists(f"mlxq:{{{rid}}}:result"), "no result record for the job"
        assert not worker.task.done()
        assert (await client.result(good, timeout=60)).usage.completion_tokens == 16
        ok = await client.generate(model=MODEL, prompt="still alive", max_tokens=4, timeout=60)
        assert ok.usage.completion_tokens == 4
    finally:
        await r.aclose()


@pytest.mark.parametrize("kind", sorted(UNDECODABLE))
async def test_undecodable_job_ends_with_a_bad_request_event(worker: RunningWorker, client: Client, redis_url: str,
                                                             kind: str) -> None:
    """arq fails such a job (invalid UTF-8, not JSON, bad envelope, wrong arity) before ModelService.run_job
    runs, so nothing publishes an event and subscribers wait forever. Fix idea: ``api.connection.loads_job``
    never raises but maps an undecodable job to a call that emits ``error(bad_request)``."""
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = await put_raw_job(r, UNDECODABLE[kind])
        await wait_picked_up(r, rid)
        end = terminal(await collect(client, rid, timeout=0.3))
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST
    finally:
        await r.aclose()


@pytest.mark.parametrize("kind", sorted(POISON))
async def test_malformed_job_envelope_does_not_kill_the_worker(worker: RunningWorker, client: Client,
                                                               redis_url: str, kind: str) -> None:
    """arq.Worker.run_job reads ``et``/``t``/``f`` outside its job try/except; the TypeError is re-raised by
    ``_poll_iteration`` (``t.result()``) and ends ``Worker.async_run``: the process stops serving, and the
    job stays queued (in-progress key for job_timeout + 10 s), so a restarted worker dies on it again.
    Fix idea: ``api.connection.loads_job`` checks the envelope types (f: str, a: list, k: dict, t: int or
    None, et: int) and raises ValueError, which arq handles as a DeserializationError."""
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = await put_raw_job(r, POISON[kind])
        await wait_picked_up(r, rid)
        await asyncio.sleep(0.2)
        assert not worker.task.done(), f"the arq worker died: {worker.task.exception()!r}"
    finally:
        await r.aclose()


# --- limits ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", [
    {"id": JOB_ID, "model": MODEL, "prompt": "hi", "x" * 100_000: 1},
    {"id": JOB_ID, "model": MODEL, "prompt": "hi", "metadata": {"k" * 100_000: "v"}},
], ids=["unknown_field", "metadata_key"])
def test_bad_request_message_is_bounded(validator: Validator, payload: dict[str, Any]) -> None:
    """``api.errors.describe`` puts pydantic error locations in the message verbatim: an unknown field
    name or a metadata key of N chars gives an N-char error event (published, and kept in the replay log)."""
    message = validator.check(payload, JOB_ID)
    assert isinstance(message, str)
    assert len(message) <= 4096, f"error message of {len(message)} chars"


async def test_oversized_prompt_is_refused_without_stalling_the_worker(worker: RunningWorker, client: Client,
                                                                       redis_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema-valid chat of 2 x 1M chars (the schema allows up to 1,000 x 1M) was tokenized in full, on the
    worker's event loop, before the prompt-token limit (512 here) refused it: every job's event delivery and
    lease refresh froze meanwhile. Now its character count refuses it before anything tokenizes it, and an
    ordinary job queued beside it is served."""
    encoded: list[str] = []

    def recording(req: GenerateRequest, model: ModelView, inline: bool) -> Any:
        encoded.append(req.id)
        return encode(req, model, inline)

    monkeypatch.setattr(prompt_stage, "encode", recording)
    rid = uuid.uuid4().hex
    payload = {"id": rid, "model": MODEL, "messages": [{"role": "user", "content": "a" * MAX_PROMPT_CHARS}] * 2}
    await enqueue_raw(redis_url, payload, rid, MODEL)
    ordinary = await client.submit(model=MODEL, prompt="an ordinary job beside it", max_tokens=5)
    end = terminal(await collect(client, rid))
    assert isinstance(end, ErrorEvent) and end.code is ErrorCode.BAD_REQUEST
    limit = worker.host.config.max_payload_bytes
    assert end.message == f"the prompt has {2 * MAX_PROMPT_CHARS} characters; the limit is {limit}"
    assert rid not in encoded
    assert (await client.result(ordinary, timeout=60)).usage.completion_tokens == 5  # the worker serves on
    assert ordinary in encoded
