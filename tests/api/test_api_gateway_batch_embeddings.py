"""Embedding batches and the output files' expiry, with the official ``openai`` SDK as the client: a real gateway
(which feeds the batches), a real Redis and real worker processes on the generated tiny embedding model
(``embed``) and the tiny chat model (``chat``). Each good line of an ``/v1/embeddings`` batch equals
``embeddings.create`` of the same request; bad lines are in the error file; a line naming a model of the other
kind is that line's error in a batch of either endpoint; ``output_expires_after`` sets the output and error files'
``expires_at`` and their keys' TTL in Redis, and a value OpenAI refuses is its 400."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest
from mlxq.api.protocol.keys import Keys
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, embed_and_chat

pytestmark = pytest.mark.e2e

TEXTS = ["hello world", "a much longer sentence about the queue, its workers and their model", "the server"]
URL = "/v1/embeddings"


@pytest.fixture(scope="module")
def served(tiny_embed_model: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, ServedGateway]]:
    """Two workers (an embedding model, a chat model) and a gateway that feeds batches."""
    with embed_and_chat(tiny_embed_model, tiny_model, tmp_path_factory.mktemp("gw-batch-embed")) as served:
        yield served


@pytest.fixture
async def redis(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[aredis.Redis]:
    conn = aredis.Redis.from_url(served[0].redis.url)
    yield conn
    await conn.aclose()


def embed_line(cid: str, model: str = "embed", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": URL, "body": {"model": model, **body}}


def chat_line(cid: str, model: str = "chat") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def run_batch(oai: openai.AsyncOpenAI, lines: list[Any], endpoint: str = URL, **create: Any) -> Any:
    """Upload ``lines``, create their batch and poll it to its end."""
    f = await oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = await oai.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",  # type: ignore[arg-type]
                                 **create)
    async with asyncio.timeout(180):
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.3)
            b = await oai.batches.retrieve(b.id)
    return b


async def lines_of(oai: openai.AsyncOpenAI, fid: str | None) -> dict[str, dict[str, Any]]:
    """A result file's lines by custom_id."""
    if fid is None:
        return {}
    content = (await oai.files.content(fid)).content
    return {o["custom_id"]: o for o in (json.loads(line) for line in content.splitlines() if line.strip())}


def vector(given: Any) -> Any:
    """An embedding as floats: a base64 one (little-endian float32) decoded."""
    return np.frombuffer(base64.b64decode(given), "<f4") if isinstance(given, str) else np.asarray(given, "<f4")


def same(got: Any, want: Any) -> bool:
    v, w = vector(got), vector(want)
    return v.shape == w.shape and float(v @ w / (np.linalg.norm(v) * np.linalg.norm(w))) >= 0.99999


async def test_an_embeddings_batch_answers_each_line_as_embeddings_create(oai: openai.AsyncOpenAI) -> None:
    good: dict[str, dict[str, Any]] = {
        "text": {"input": TEXTS[0]},
        "texts": {"input": TEXTS, "encoding_format": "float"},
        "ids": {"input": [[5, 6, 7, 8], [9, 10]]},
        "cut": {"input": TEXTS[1], "dimensions": 16},
        "b64": {"input": [TEXTS[2]], "encoding_format": "base64", "dimensions": 32},
    }
    lines: list[Any] = [embed_line(cid, **body) for cid, body in good.items()]
    lines += [embed_line("empty", input=""), b'{"custom_id": "broken", "url": "/v1/embeddings", "body":',
              embed_line("wide", input="fine", dimensions=65)]  # the model's vectors have 64
    b = await run_batch(oai, lines)
    assert b.status == "completed", b
    assert b.request_counts is not None and (b.request_counts.completed, b.request_counts.failed) == (5, 3)
    out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
    assert set(out) == set(good)
    for cid, body in good.items():
        o = out[cid]
        assert o["error"] is None and o["response"]["status_code"] == 200
        got = o["response"]["body"]
        alone = await oai.embeddings.create(model="embed", **body)  # the same request sent alone
        assert got["object"] == "list" and got["model"] == "embed" and got["usage"] == alone.usage.model_dump()
        assert [d["index"] for d in got["data"]] == [d.index for d in alone.data]
        for item, want in zip(got["data"], alone.data, strict=True):
            assert isinstance(item["embedding"], str) == (body.get("encoding_format") == "base64")
            assert same(item["embedding"], want.embedding), cid
    assert b.usage is not None and b.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"]
                                                               for o in out.values())
    codes = {cid: e["error"]["code"] for cid, e in err.items() if e["response"] is None}  # broken: no custom_id
    assert codes == {"empty": "invalid_request", None: "invalid_json_line", "wide": "invalid_request"}
    assert "input" in err["empty"]["error"]["message"] and "dimensions" in err["wide"]["error"]["message"]


async def test_a_line_naming_a_model_of_the_other_kind_is_that_lines_error(oai: openai.AsyncOpenAI) -> None:
    embeds = run_batch(oai, [embed_line("e0", input="hi"), embed_line("e1", model="chat", input="hi")])
    chats = run_batch(oai, [chat_line("c0"), chat_line("c1", model="embed")], endpoint="/v1/chat/completions")
    e, c = await asyncio.gather(embeds, chats)  # both at once, each model's worker serving its own lines
    assert (e.status, c.status) == ("completed", "completed")
    e_out, e_err = await lines_of(oai, e.output_file_id), await lines_of(oai, e.error_file_id)
    c_out, c_err = await lines_of(oai, c.output_file_id), await lines_of(oai, c.error_file_id)
    assert set(e_out) == {"e0"} and len(e_out["e0"]["response"]["body"]["data"][0]["embedding"]) == 64
    assert set(c_out) == {"c0"} and c_out["c0"]["response"]["body"]["object"] == "chat.completion"
    assert "does not make embeddings" in e_err["e1"]["error"]["message"]
    assert "is an embedding model" in c_err["c1"]["error"]["message"]


async def test_output_expires_after_sets_the_result_files_expiry(oai: openai.AsyncOpenAI,
                                                                 redis: aredis.Redis) -> None:
    policy = {"anchor": "created_at", "seconds": 7200}
    b = await run_batch(oai, [embed_line("ok", input="hi"), embed_line("bad", input="")],
                        output_expires_after=policy)
    assert b.output_file_id and b.error_file_id
    keys = Keys(PREFIX)
    for fid in (b.output_file_id, b.error_file_id):
        f = await oai.files.retrieve(fid)
        assert f.expires_at == f.created_at + 7200  # anchored at the file's creation (OpenAI's)
        for key in (keys.file(fid), keys.file_chunks(fid)):
            assert 7200 - 60 < await redis.ttl(key) <= 7200
    default = await run_batch(oai, [embed_line("ok", input="hi")])  # none given: the file retention (30 days)
    assert default.output_file_id
    f = await oai.files.retrieve(default.output_file_id)
    assert f.expires_at == f.created_at + 30 * 86_400


@pytest.mark.parametrize(("policy", "param", "code"), [
    ({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds", "integer_below_min_value"),
    ({"anchor": "created_at", "seconds": 2_592_001}, "output_expires_after.seconds", "integer_above_max_value"),
    ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds", "invalid_type"),
    ({"anchor": "last_active_at", "seconds": 3600}, "output_expires_after.anchor", "invalid_value"),
    ({"seconds": 3600}, "output_expires_after.anchor", "missing_required_parameter"),
    ({"anchor": "created_at", "seconds": 3600, "days": 1}, "output_expires_after.days", "unknown_parameter"),
    ("3600", "output_expires_after", "invalid_type"),
])
async def test_an_output_expiry_openai_refuses_is_its_400(oai: openai.AsyncOpenAI, policy: Any, param: str,
                                                          code: str) -> None:
    f = await oai.files.create(file=("in.jsonl", jsonl([embed_line("a", input="hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h",
                                 output_expires_after=policy)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_client_and_mlxq_batches_take_output_expires_after(served: tuple[Deployment, ServedGateway],
                                                                  tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([embed_line("a", input="hi")]))
    env = {**os.environ, "MLXQ_REDIS_URL": served[0].redis.url, "MLXQ_PREFIX": PREFIX}
    made = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mlxq.api.cli", "batches", "--json", "create",
                                                    str(path), "--endpoint", URL, "--output-expires-after", "60"],
                                   env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 2 and "output_expires_after.seconds" in made.stderr and made.stderr.count("\n") == 1
    async with Client(config=served[0].config.client) as queue:
        with pytest.raises(BadRequest) as refused:
            await queue.create_batch([embed_line("a", input="hi")], endpoint=URL,
                                     output_expires_after={"anchor": "created_at", "seconds": 60})
        assert refused.value.param == "output_expires_after.seconds"
        b = await queue.create_batch([embed_line("a", input="hi")], endpoint=URL,
                                     output_expires_after={"anchor": "created_at", "seconds": 3600})
        async with asyncio.timeout(120):
            while (b := await queue.batch(b["id"]))["status"] != "completed":
                await asyncio.sleep(0.3)
        out = await queue.batch_store().files.get(b["output_file_id"], "default")
        assert out["expires_at"] == out["created_at"] + 3600
