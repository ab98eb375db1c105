"""What each API's request becomes as a queue job, field by field, and the gateway's configuration and keys.
No server: the dialects' ``parse`` and the config are plain functions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.deltas import Delta
from mlxq.api.errors import ConfigError
from mlxq.api.gateway import GatewayConfig
from mlxq.api.gateway.anthropic_api import MESSAGES
from mlxq.api.gateway.auth import Auth
from mlxq.api.gateway.config import max_tokens_fields
from mlxq.api.gateway.content import chat_content
from mlxq.api.gateway.errors import GatewayError
from mlxq.api.gateway.openai_api import CHAT, COMPLETIONS
from mlxq.api.schema import (
    MAX_TOKENS_CEILING,
    DoneEvent,
    FinishReason,
    FunctionCall,
    ImagePart,
    ImageURL,
    TextPart,
    Timings,
    ToolCall,
    Usage,
    decode_event,
)

pytestmark = pytest.mark.unit

CONFIG = GatewayConfig(default_max_tokens=77)
ROOT = Path(__file__).resolve().parents[2]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def test_a_chat_request_maps_every_sampling_field_onto_the_job() -> None:
    ask = CHAT.parse(body(
        model="m", messages=[{"role": "developer", "content": "be terse"}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": None}, {"role": "tool", "content": "42"}],
        max_completion_tokens=9, max_tokens=99, temperature=0.7, top_p=0.8, seed=3, stop="END",
        presence_penalty=0.1, frequency_penalty=-0.2, top_k=40, min_p=0.05, repetition_penalty=1.1, priority=5,
        user="u1", metadata={"team": "a"}, stream=True, stream_options={"include_usage": True}, store=False,
    ), CONFIG)
    req = ask.request
    assert [(m.role, m.content) for m in req.messages or []] == [
        ("system", "be terse"), ("user", "hi"), ("assistant", ""), ("tool", "42")]
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (9, 0.7, 0.8, 3, ["END"])
    assert (req.presence_penalty, req.frequency_penalty, req.top_k, req.min_p) == (0.1, -0.2, 40, 0.05)
    assert (req.repetition_penalty, req.priority, req.metadata) == (1.1, 5, {"team": "a", "user": "u1"})
    assert ask.stream and ask.include_usage


def test_what_a_request_leaves_out_takes_the_gateways_defaults() -> None:
    ask = COMPLETIONS.parse(body(model="m", prompt=["once"], stop=["", "x"]), CONFIG)
    req = ask.request
    assert (req.prompt, req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == ("once", 77, 0.0, 1.0,
                                                                                          None, ["x"])
    assert not ask.stream and not ask.include_usage
    assert req.fit_max_tokens  # the worker lowers the default to what fits the context
    assert not COMPLETIONS.parse(body(model="m", prompt="once", max_tokens=5), CONFIG).request.fit_max_tokens


def test_a_request_naming_no_max_tokens_has_no_cap_of_the_gateways_unless_the_operator_sets_one() -> None:
    # OpenAI's API: up to the context; the worker lowers the ceiling to what fits (and to its MLXQ_MAX_TOKENS)
    req = CHAT.parse(body(model="m", messages=[{"role": "user", "content": "hi"}]), GatewayConfig()).request
    assert req.fit_max_tokens and req.max_tokens == MAX_TOKENS_CEILING
    assert max_tokens_fields(0) == {"max_tokens": 0, "fit_max_tokens": False}  # named, refused as it is
    capped = GatewayConfig.from_env({"MLXQ_GATEWAY_MAX_TOKENS": "512"})
    assert COMPLETIONS.parse(body(model="m", prompt="once"), capped).request.max_tokens == 512


def test_a_message_request_maps_system_blocks_stops_and_sampling() -> None:
    ask = MESSAGES.parse(body(
        model="m", max_tokens=12, system=[{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
        stop_sequences=["\n\nHuman:"], temperature=0.5, top_p=0.9, top_k=20, metadata={"user_id": "u"},
        stream=True, thinking={"type": "disabled"}, service_tier="auto",
    ), CONFIG)
    req = ask.request
    assert [(m.role, m.content) for m in req.messages or []] == [
        ("system", "be kind"), ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    assert (req.max_tokens, req.stop, req.temperature, req.top_p, req.top_k) == (12, ["\n\nHuman:"], 0.5, 0.9, 20)
    assert req.metadata == {"user_id": "u"} and ask.stream


@pytest.mark.parametrize("content", [None, "", []])
def test_empty_content_is_empty_text(content: Any) -> None:
    assert chat_content(content, "messages[0]") == ""


def test_image_parts_pass_through_in_either_apis_shape() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    openai = chat_content([{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": url}},
                           {"type": "text", "text": "here"}], "messages[0]")
    anthropic = chat_content([{"type": "text", "text": "look "},
                              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                           "data": "iVBORw0KGgo="}},
                              {"type": "text", "text": "here"}], "messages[0]")
    assert openai == anthropic == [TextPart(type="text", text="look "),
                                   ImagePart(type="image_url", image_url=ImageURL(url=url)),
                                   TextPart(type="text", text="here")]
    by_url = chat_content([{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}], "m")
    assert by_url == [ImagePart(type="image_url", image_url=ImageURL(url="https://x/y.png"))]


def test_content_parts_other_than_text_and_images_are_refused_by_name() -> None:
    with pytest.raises(GatewayError, match=r"messages\[1\]\.content\[1\]: an image source is base64"):
        chat_content([{"type": "text", "text": "look"}, {"type": "image", "source": {}}], "messages[1]")
    with pytest.raises(GatewayError, match="content parts of type 'input_audio' are not supported"):
        chat_content([{"type": "input_audio"}], "messages[0]")
    with pytest.raises(GatewayError, match="needs a string 'text'"):
        chat_content([{"type": "text", "text": 3}], "messages[0]")


def test_the_config_is_read_once_from_mlxq_variables() -> None:
    cfg = GatewayConfig.from_env({"MLXQ_API_KEYS": " a, b ,,", "MLXQ_GATEWAY_MAX_BODY": "2048",
                                  "MLXQ_GATEWAY_MAX_TOKENS": "64", "MLXQ_GATEWAY_HOST": "0.0.0.0",
                                  "MLXQ_GATEWAY_PORT": "9000", "MLXQ_REDIS_URL": "redis://r:1", "MLXQ_PREFIX": "p",
                                  "MLXQ_MAX_QUEUED": "5"})
    assert (cfg.api_keys, cfg.max_body_bytes, cfg.default_max_tokens) == (frozenset({"a", "b"}), 2048, 64)
    named = GatewayConfig.from_env({"MLXQ_API_KEYS": "k1=acme, k2, pad=="})
    assert named.api_keys == frozenset({"k1=acme", "k2", "pad=="})
    with pytest.raises(ConfigError, match="MLXQ_API_KEYS: entry 2 names tenant 'no good'") as refused:
        GatewayConfig.from_env({"MLXQ_API_KEYS": "k1=acme,secret-key=no good"})
    assert "secret-key" not in str(refused.value)
    assert (cfg.host, cfg.port, cfg.client.redis_url, cfg.client.prefix, cfg.client.max_queued) == (
        "0.0.0.0", 9000, "redis://r:1", "p", 5)
    assert GatewayConfig.from_env({}) == GatewayConfig()


def test_keys_are_taken_as_bearer_tokens_or_x_api_key() -> None:
    auth = Auth(frozenset({"secret"}))
    auth.check({"authorization": "Bearer secret"})
    auth.check({"x-api-key": "secret"})
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic secret"}, {"x-api-key": ""}):
        with pytest.raises(GatewayError) as caught:
            auth.check(headers)
        assert caught.value.problem.status == 401
    Auth(frozenset()).check({})  # no keys configured: open


def test_the_producer_side_never_loads_the_web_stack() -> None:
    # `pip install mlxq` has no Starlette: the client and the CLI must import without it.
    code = ("import sys, api.client, api.cli, api.gateway.config; "
            "web = sorted(m for m in sys.modules if m.split('.')[0] in {'starlette', 'uvicorn', "
            "'fastapi'}); print(web); sys.exit(1 if web else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_gateways_public_names() -> None:
    import mlxq.api.gateway

    assert mlxq.api.gateway.__all__ == ["Gateway", "GatewayConfig", "create_app"]
    assert all(getattr(mlxq.api.gateway, name) is not None for name in mlxq.api.gateway.__all__)


def test_a_done_event_carries_the_stop_sequence_that_ended_it_and_only_then() -> None:
    timings = Timings(queue_ms=0.0, ttft_ms=None, total_ms=1.0, tokens_per_s=None)
    plain = DoneEvent(id="r", seq=3, finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=1, completion_tokens=2),
                      timings=timings)
    assert "stop_sequence" not in plain.model_dump_json()  # so a producer of an earlier release reads it
    stopped = DoneEvent(**{**plain.model_dump(), "stop_sequence": "END"})
    assert decode_event(stopped.model_dump_json()) == stopped and stopped.stop_sequence == "END"
    assert decode_event(plain.model_dump_json()).stop_sequence is None


class _Ended:
    """A choice's job as a stream's last frames read it: how it ended."""

    def __init__(self, reason: FinishReason) -> None:
        self.done = DoneEvent(id="r", seq=1, finish_reason=reason, usage=Usage(prompt_tokens=1, completion_tokens=2),
                              timings=Timings(queue_ms=0.0, ttft_ms=None, total_ms=1.0, tokens_per_s=None))


class _OneChoice:
    """One job's deltas, as a stream reads them."""

    rid = "r"

    def __init__(self, deltas: list[Delta], reason: FinishReason) -> None:
        self.jobs, self._deltas = [_Ended(reason)], deltas

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        for delta in self._deltas:
            yield 0, delta


@pytest.mark.parametrize(("texts", "reason", "content"), [
    (["\n", "CALL", "\n\n"], FinishReason.TOOL_CALLS, ""),  # whitespace beside calls: no content, as OpenAI's
    (["\n", "Hi", " ", "\n"], FinishReason.STOP, "\nHi \n"),  # no calls: held whitespace is content after all
    (["\n", "Hi", "CALL", " "], FinishReason.TOOL_CALLS, "\nHi"),
])
async def test_a_stream_with_tools_sends_no_whitespace_beside_calls_as_content(texts: list[str], reason: FinishReason,
                                                                                content: str) -> None:
    call = ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))
    deltas = [Delta("", tool_calls=(call,)) if t == "CALL" else Delta(t) for t in texts]
    ask = CHAT.parse(body(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                          tools=[{"type": "function", "function": {"name": "f"}}]), CONFIG)
    frames = [f async for f in CHAT.frames(ask, _OneChoice(deltas, reason))]  # type: ignore[arg-type]
    chunks = [json.loads(line[6:]) for line in b"".join(frames).decode().splitlines()
              if line.startswith("data: {")]
    sent = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert "".join(t or "" for t in sent) == content


@pytest.mark.parametrize("env", [
    {},
    {"MLXQ_MAX_IMAGES": "9", "MLXQ_MAX_IMAGE_BYTES": str(16 << 20), "MLXQ_MAX_PAYLOAD_BYTES": str(2 << 20)},
    {"MLXQ_MAX_IMAGES": "0", "MLXQ_MAX_PAYLOAD_BYTES": "4096"},
])
async def test_the_gateways_job_limits_are_the_workers_for_the_same_variables(env: dict[str, str]) -> None:
    from mlxq.api.client import Client
    from mlxq.worker.config import WorkerConfig

    worker = WorkerConfig.from_env(env)
    cfg = GatewayConfig.from_env(env)
    assert cfg.client.max_job_bytes == worker.max_job_bytes == cfg.max_body_bytes
    async with Client(config=cfg.client) as queue:  # the gateway's queue client checks jobs against them
        assert (queue.max_payload_bytes, queue.max_image_job_bytes) == (worker.max_payload_bytes,
                                                                         worker.max_job_bytes)
