"""Embeddings through the queue, with the official ``openai`` SDK as the client: a real gateway, a real Redis and
real arq workers on the generated tiny embedding model (``embed``) and the tiny chat model (``chat``). Every vector
equals the model's own pooled output computed alone with mlx-lm (its inner model, last token, normalised); inputs of
concurrent jobs go through the engine in one forward pass; bad input and a model of the other kind are 400s that
name the field."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import openai
import pytest

from mlxq.api.client import Client
from mlxq.api.errors import JobFailed
from mlxq.api.gateway import create_app
from mlxq.api.schema import ErrorCode
from mlxq.worker.config import WorkerConfig
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, embed_and_chat, post
from tests.support import start_worker

pytestmark = pytest.mark.e2e

TEXTS = ["hello world", "a much longer sentence about the queue, its workers and their model", "the server"]


@pytest.fixture(scope="module")
def served(tiny_embed_model: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, ServedGateway]]:
    with embed_and_chat(tiny_embed_model, tiny_model, tmp_path_factory.mktemp("gw-embed")) as served:
        yield served


@pytest.fixture(scope="module")
def reference(tiny_embed_model: Path) -> Any:
    """The model's pooled output of one input computed alone with mlx-lm (tokens: as its tokenizer makes them)."""
    model, tokenizer = mlx_lm.load(str(tiny_embed_model))

    def vector(given: str | list[int], dimensions: int | None = None) -> np.ndarray:
        tokens = tokenizer.encode(given) if isinstance(given, str) else given
        state = np.asarray(model.model(mx.array([tokens]))[0, -1].astype(mx.float32))[:dimensions]
        return state / np.linalg.norm(state)

    vector.encode = tokenizer.encode  # type: ignore[attr-defined]
    return vector


def same(got: Any, want: np.ndarray) -> bool:
    v = np.asarray(got, dtype=np.float32)
    return v.shape == want.shape and float(v @ want / np.linalg.norm(v)) >= 0.99999


async def test_a_string_a_list_and_token_ids_equal_the_models_pooled_output(oai: openai.AsyncOpenAI,
                                                                          reference: Any) -> None:
    one = await oai.embeddings.create(model="embed", input=TEXTS[0])  # the SDK asks for base64 and decodes it
    assert len(one.data) == 1 and same(one.data[0].embedding, reference(TEXTS[0]))
    tokens = len(reference.encode(TEXTS[0]))
    assert one.usage.prompt_tokens == tokens == one.usage.total_tokens and one.model == "embed"
    many = await oai.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert all(same(d.embedding, reference(t)) for d, t in zip(many.data, TEXTS, strict=True))
    assert many.usage.prompt_tokens == sum(len(reference.encode(t)) for t in TEXTS)
    ids = [[5, 6, 7, 8], [9, 10]]  # pooled as given: no token appended
    by_ids = await oai.embeddings.create(model="embed", input=ids)
    assert all(same(d.embedding, reference(i)) for d, i in zip(by_ids.data, ids, strict=True))
    assert by_ids.usage.prompt_tokens == 6
    flat = await oai.embeddings.create(model="embed", input=[5, 6, 7, 8])
    assert len(flat.data) == 1 and same(flat.data[0].embedding, reference([5, 6, 7, 8]))


async def test_base64_is_little_endian_float32_and_dimensions_cut_and_normalise(
        served: tuple[Deployment, ServedGateway], reference: Any) -> None:
    resp = await post(served[1].url, "/v1/embeddings", {"model": "embed", "input": TEXTS[1],
                                                        "encoding_format": "base64", "dimensions": 16})
    assert resp.status_code == 200, resp.text
    (item,) = resp.json()["data"]
    v = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
    assert v.shape == (16,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5 and same(v, reference(TEXTS[1], 16))
    floats = (await post(served[1].url, "/v1/embeddings", {"model": "embed", "input": [TEXTS[1]],
                                                           "dimensions": 16})).json()
    assert np.allclose(floats["data"][0]["embedding"], v, atol=1e-7)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": "x " * 600}, "input"),  # past the model's 512 tokens: the worker refuses it
    ({"input": "fine", "dimensions": 0}, "dimensions"),
    ({"input": "fine", "dimensions": 65}, "dimensions"),  # the model's vectors have 64
    ({"input": [[100000]]}, "input"),  # not in its vocabulary
])
async def test_bad_input_is_a_400_naming_the_field(served: tuple[Deployment, ServedGateway],
                                                   body: dict[str, Any], param: str) -> None:
    resp = await post(served[1].url, "/v1/embeddings", {"model": "embed", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


async def test_the_sdk_sees_a_bad_request_error(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.embeddings.create(model="embed", input="fine", dimensions=1000)
    assert caught.value.status_code == 400 and "dimensions" in str(caught.value)


async def test_a_model_of_the_other_kind_is_one_clear_error(oai: openai.AsyncOpenAI,
                                                            served: tuple[Deployment, ServedGateway]) -> None:
    with pytest.raises(openai.BadRequestError) as embedding_to_chat:
        await oai.embeddings.create(model="chat", input="hello")
    assert "does not make embeddings" in str(embedding_to_chat.value) and embedding_to_chat.value.param == "model"
    with pytest.raises(openai.BadRequestError) as chat_to_embedding:
        await oai.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "is an embedding model" in str(chat_to_embedding.value)
    async with Client(config=served[0].config.client) as queue:  # one error event, code and message
        with pytest.raises(JobFailed) as failed:
            await queue.generate(model="embed", prompt="hi", max_tokens=4, timeout=30)
        assert failed.value.code is ErrorCode.BAD_REQUEST and "embedding model" in failed.value.event.message
        with pytest.raises(JobFailed) as failed:
            await queue.embed(model="chat", input="hi", timeout=30)
        assert failed.value.code is ErrorCode.BAD_REQUEST


async def test_client_embed_returns_the_vectors_and_the_usage(served: tuple[Deployment, ServedGateway],
                                                              reference: Any) -> None:
    async with Client(config=served[0].config.client) as queue:
        got = await queue.embed(model="embed", input=TEXTS, dimensions=32, timeout=30)
        assert len(got.vectors) == 3 and all(len(v) == 32 for v in got.vectors)
        assert all(same(v, reference(t, 32)) for v, t in zip(got.vectors, TEXTS, strict=True))
        assert got.usage.prompt_tokens == sum(len(reference.encode(t)) for t in TEXTS)
        assert got.usage.completion_tokens == 0 and got.finish_reason.value == "stop"
        alone = await queue.embed(model="embed", input=[1, 2, 3], timeout=30)
        assert len(alone.vectors) == 1 and same(alone.vectors[0], reference([1, 2, 3]))


# --- batching: an in-process worker, whose engine's counters the test reads -----------------------------------
@pytest.fixture
async def batching(redis_url: str, tiny_embed_model: Path) -> AsyncIterator[tuple[Any, ServedGateway]]:
    config = WorkerConfig(model=str(tiny_embed_model), model_name="embed", redis_url=redis_url, prefix=PREFIX,
                          capacity=32, admit_wait_ms=2000)  # an idle engine waits for the whole claimed burst
    running = await start_worker(config)
    gw = ServedGateway(create_app(_gateway_config(redis_url))).start()
    try:
        yield running, gw
    finally:
        gw.stop()
        await running.close()


def _gateway_config(redis_url: str) -> Any:
    from mlxq.api.config import ClientConfig
    from mlxq.api.gateway import GatewayConfig

    return GatewayConfig(client=ClientConfig(redis_url=redis_url, prefix=PREFIX))


async def test_inputs_of_concurrent_jobs_go_through_in_one_forward_pass(batching: tuple[Any, ServedGateway],
                                                                       reference: Any) -> None:
    running, gw = batching
    counts = running.service.engine.scheduler.counts
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as oai:
        await oai.embeddings.create(model="embed", input="warm up")
        before = counts.passes
        running.worker.allow_pick_jobs = False  # the jobs queue up, then one claim takes them all
        jobs = [asyncio.ensure_future(oai.embeddings.create(model="embed", input=[t, f"job {i}"]))
                for i, t in enumerate(TEXTS * 2)]
        await _queued(running, len(jobs))
        running.worker.allow_pick_jobs = True
        results = await asyncio.gather(*jobs)
    assert counts.passes == before + 1 and counts.largest >= 2 * len(jobs)
    for i, (resp, text) in enumerate(zip(results, TEXTS * 2, strict=True)):
        assert same(resp.data[0].embedding, reference(text)) and same(resp.data[1].embedding, reference(f"job {i}"))


async def _queued(running: Any, n: int) -> None:
    redis, queue = running.host.redis, running.host.keys.queue("embed")
    for _ in range(1000):
        if await redis.zcard(queue) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} jobs did not queue")
