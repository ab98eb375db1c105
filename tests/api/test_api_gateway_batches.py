"""OpenAI's Files and Batch APIs, with the official ``openai`` SDK as the client: a real gateway (uvicorn), a real
Redis and real worker processes on the tiny model. Every good line is answered once, with the greedy text of the
same request sent alone; every bad line is in the error file; a batch survives a gateway killed mid-batch (another
takes it over) and a worker killed mid-batch (its jobs run again): each custom_id once across both files."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlxq.api.client import Client
from mlxq.api.errors import BadRequest, NotFound
from mlxq.worker.tools.process import GatewayProcess
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway

pytestmark = pytest.mark.e2e

PROMPTS = ["Say hello", "Count to three", "Name a colour", "What is two plus two", "Tell me a word",
           "Write a letter", "Pick a fruit", "Say goodbye"]


FEEDERS: list[GatewayProcess] = []  # the one gateway process that feeds batches (the tests' gateway feeds none)


def feeder(d: Deployment) -> GatewayProcess:
    # A line for a model no worker serves is that line's error after 2 s (30 by default: a restarting worker's).
    env = {"MLXQ_REDIS_URL": d.redis.url, "MLXQ_PREFIX": PREFIX, "MLXQ_BATCH_WINDOW": "32",
           "MLXQ_BATCH_NO_WORKER_WAIT": "2", "OPENBLAS_NUM_THREADS": "1"}
    proc = GatewayProcess(env, d.workdir / f"feeder-{len(FEEDERS)}.log").start()
    proc.wait_ready()
    FEEDERS.append(proc)
    return proc


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    """A worker, a gateway the SDK talks to (feeding no batches), and a gateway process that feeds them: the
    one feeder, so killing it kills the batch's driver."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    d = Deployment(tiny_model, tmp_path_factory.mktemp("gw-batches"))
    try:
        d.worker("tiny")
        feeder(d)
        with d.gateway(batch_window=0) as gw:
            yield d, gw
    finally:
        for proc in FEEDERS:
            proc.stop()
        d.close()


@pytest.fixture
async def queue(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[Client]:
    async with Client(config=served[0].config.client) as c:
        yield c


def chat_line(cid: str, prompt: str, max_tokens: int = 6, model: str = "tiny") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "temperature": 0}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def upload(oai: openai.AsyncOpenAI, data: bytes) -> str:
    f = await oai.files.create(file=("in.jsonl", data), purpose="batch")
    return f.id


async def ended(oai: openai.AsyncOpenAI, bid: str, timeout: float = 240) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            b = await oai.batches.retrieve(bid)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                return b
            await asyncio.sleep(0.5)


async def lines_of(oai: openai.AsyncOpenAI, fid: str | None) -> list[dict[str, Any]]:
    if fid is None:
        return []
    content = await oai.files.content(fid)
    return [json.loads(line) for line in content.content.splitlines() if line.strip()]


async def solo(queue: Client, prompt: str, max_tokens: int = 6) -> str:
    r = await queue.generate(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                             temperature=0, timeout=60)
    return r.text


def once_each(out: list[dict[str, Any]], err: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every line by custom_id, asserting none is reported twice."""
    seen: dict[str, dict[str, Any]] = {}
    for line in out + err:
        cid = line["custom_id"]
        assert cid not in seen, f"{cid} reported twice"
        seen[cid] = line
    return seen


# --- files ----------------------------------------------------------------------------------------------------
async def test_a_file_is_uploaded_read_listed_and_deleted(oai: openai.AsyncOpenAI) -> None:
    data = jsonl([chat_line(f"f{i}", "hi") for i in range(3)])
    f = await oai.files.create(file=("mine.jsonl", data), purpose="batch")
    assert (f.bytes, f.filename, f.purpose, f.object) == (len(data), "mine.jsonl", "batch", "file")
    assert (await oai.files.retrieve(f.id)).id == f.id
    assert (await oai.files.content(f.id)).content == data
    assert f.id in [x.id async for x in oai.files.list(purpose="batch")]
    deleted = await oai.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        await oai.files.retrieve(f.id)


async def test_a_file_over_the_limits_is_refused(served: tuple[Deployment, ServedGateway]) -> None:
    d, _ = served
    with d.gateway(batch_max_lines=3, batch_max_file_bytes=2000, batch_window=0) as small:
        oai = openai.AsyncOpenAI(base_url=f"{small.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="MLXQ_BATCH_MAX_LINES"):
            await upload(oai, jsonl([chat_line(f"l{i}", "hi") for i in range(4)]))
        with pytest.raises(openai.APIStatusError, match="MLXQ_BATCH_MAX_FILE_BYTES") as big:
            await upload(oai, jsonl([chat_line("big", "x" * 3000)]))
        assert big.value.status_code == 413
        await oai.close()


# --- batches --------------------------------------------------------------------------------------------------
async def test_a_batch_answers_every_good_line_once_as_alone(oai: openai.AsyncOpenAI, queue: Client) -> None:
    lines: list[Any] = [chat_line(f"c{i}", PROMPTS[i % len(PROMPTS)]) for i in range(160)]
    lines[7] = b"{not json"
    lines[20] = {"custom_id": "c20", "method": "POST", "url": "/v1/completions", "body": {}}  # not the endpoint
    lines[33] = chat_line("c5", "dup")  # c5 again
    lines[41] = {**chat_line("c41", "hi"), "body": {"model": "tiny", "messages": []}}  # the endpoint refuses it
    lines[50] = chat_line("c50", "hi", model="no-such-model")
    fid = await upload(oai, jsonl(lines))
    b = await oai.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"run": "mixed"})
    assert b.status == "validating" and b.metadata == {"run": "mixed"}
    b = await ended(oai, b.id)
    assert b.status == "completed", b
    out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
    bad = {7, 20, 33, 41, 50}
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (160, 155, 5)
    assert len(out) == 155 and len(err) == 5
    codes = {e["custom_id"]: e["error"]["code"] for e in err}
    assert codes == {None: "invalid_json_line", "c20": "invalid_url", "c5": "duplicate_custom_id",
                     "c41": "invalid_request", "c50": "model_not_found"}
    texts = {p: await solo(queue, p) for p in PROMPTS}
    good = {f"c{i}" for i in range(160) if i not in bad}
    assert {o["custom_id"] for o in out} == good
    for o in out:
        i = int(o["custom_id"][1:])
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == texts[PROMPTS[i % len(PROMPTS)]]
    assert b.usage is not None and b.usage.output_tokens > 0


async def test_a_completions_batch_answers_as_the_endpoint(oai: openai.AsyncOpenAI, queue: Client) -> None:
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": 5, "temperature": 0}}
             for i in range(40)]
    b = await oai.batches.create(input_file_id=await upload(oai, jsonl(lines)), endpoint="/v1/completions",
                                 completion_window="24h")
    b = await ended(oai, b.id)
    out = await lines_of(oai, b.output_file_id)
    assert b.status == "completed" and b.error_file_id is None and len(out) == 40
    for o in out:
        want = (await queue.generate(model="tiny", prompt=PROMPTS[int(o["custom_id"][1:]) % 4], max_tokens=5,
                                     temperature=0, timeout=60)).text
        assert o["response"]["body"]["choices"][0]["text"] == want


async def test_a_responses_batch_answers_as_the_responses_api(oai: openai.AsyncOpenAI, queue: Client) -> None:
    lines = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "tiny", "input": PROMPTS[i], "max_output_tokens": 6, "temperature": 0}}
             for i in range(4)]
    lines.append({"custom_id": "chained", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "tiny", "input": "hi", "previous_response_id": "resp_x"}})
    b = await ended(oai, (await oai.batches.create(input_file_id=await upload(oai, jsonl(lines)),
                                                   endpoint="/v1/responses", completion_window="24h")).id)
    out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
    assert b.status == "completed" and len(out) == 4
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [("chained", "invalid_request")]
    for o in out:
        body = o["response"]["body"]
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
        (message,) = [item for item in body["output"] if item["type"] == "message"]
        assert message["content"][0]["text"] == await solo(queue, PROMPTS[int(o["custom_id"][1:])])


async def test_a_file_that_is_not_jsonl_fails_the_batch(oai: openai.AsyncOpenAI) -> None:
    fid = await upload(oai, b"this is\nnot json at all\n")
    b = await ended(oai, (await oai.batches.create(input_file_id=fid, endpoint="/v1/chat/completions",
                                                   completion_window="24h")).id)
    assert b.status == "failed" and b.errors is not None and b.errors.data
    assert b.errors.data[0].code == "invalid_json_line"


async def test_a_batch_create_that_openai_refuses_is_a_400(oai: openai.AsyncOpenAI) -> None:
    fid = await upload(oai, jsonl([chat_line("a", "hi")]))
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await oai.batches.create(input_file_id=fid, endpoint="/v1/chat/completions",
                                 completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await oai.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                 completion_window="24h")


async def test_a_cancelled_batch_keeps_what_finished(oai: openai.AsyncOpenAI) -> None:
    lines = [chat_line(f"k{i}", PROMPTS[i % 8], max_tokens=40) for i in range(120)]
    b = await oai.batches.create(input_file_id=await upload(oai, jsonl(lines)), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    async with asyncio.timeout(120):
        while (now := await oai.batches.retrieve(b.id)).request_counts is None or now.request_counts.completed < 5:
            await asyncio.sleep(0.2)
    c = await oai.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    b = await ended(oai, b.id)
    assert b.status == "cancelled"
    out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
    seen = once_each(out, err)
    assert set(seen) == {f"k{i}" for i in range(120)}
    assert len(out) >= 5 and err and {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert b.request_counts is not None and b.request_counts.completed == len(out)


async def test_a_batch_past_its_window_expires(served: tuple[Deployment, ServedGateway]) -> None:
    d, _ = served
    with d.gateway(batch_completion_window_s=2) as short:  # far less than 150 x 300 tokens take
        oai = openai.AsyncOpenAI(base_url=f"{short.url}/v1", api_key="none", max_retries=0)
        lines = [chat_line(f"x{i}", PROMPTS[i % 8], max_tokens=300) for i in range(150)]
        b = await oai.batches.create(input_file_id=await upload(oai, jsonl(lines)),
                                     endpoint="/v1/chat/completions", completion_window="24h")
        b = await ended(oai, b.id)
        assert b.status == "expired" and b.expired_at is not None
        out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
        seen = once_each(out, err)
        assert set(seen) == {f"x{i}" for i in range(150)}
        assert err and {e["error"]["code"] for e in err} == {"batch_expired"}
        await oai.close()


@pytest.mark.slow  # a fault or a whole program: out of the everyday run
async def test_a_batch_survives_a_gateway_and_a_worker_killed_mid_batch(
        oai: openai.AsyncOpenAI, served: tuple[Deployment, ServedGateway], queue: Client) -> None:
    d, _ = served
    lines = [chat_line(f"r{i}", PROMPTS[i % 8], max_tokens=16) for i in range(200)]
    b = await oai.batches.create(input_file_id=await upload(oai, jsonl(lines)), endpoint="/v1/chat/completions",
                                 completion_window="24h")

    async def completed_at_least(n: int) -> None:
        async with asyncio.timeout(180):
            while (now := await oai.batches.retrieve(b.id)).request_counts is None or \
                    now.request_counts.completed < n:
                await asyncio.sleep(0.1)

    await completed_at_least(10)
    driver = FEEDERS[-1]
    assert driver.pid is not None and driver.proc is not None
    os.kill(driver.pid, signal.SIGKILL)  # the batch's feeder dies mid-batch, its lease held
    driver.proc.wait()
    feeder(d)  # a gateway restarted: it takes the batch over once the lease lapses
    await completed_at_least(80)
    d.workers[0].kill()  # kill -9 mid-batch: its jobs are run again by the next worker
    d.worker("tiny")
    b = await ended(oai, b.id, timeout=300)
    assert b.status == "completed"
    out, err = await lines_of(oai, b.output_file_id), await lines_of(oai, b.error_file_id)
    seen = once_each(out, err)
    assert set(seen) == {f"r{i}" for i in range(200)} and not err
    assert b.request_counts is not None and (b.request_counts.completed, b.request_counts.failed) == (200, 0)
    texts = {p: await solo(queue, p, 16) for p in PROMPTS}
    for o in out:
        assert o["response"]["body"]["choices"][0]["message"]["content"] == texts[PROMPTS[int(o["custom_id"][1:]) % 8]]


# --- the producer's own: Client and mlxq batches ------------------------------------------------------------------
async def test_client_batch_methods_without_the_gateway(queue: Client) -> None:
    lines = [chat_line(f"q{i}", PROMPTS[i % 8]) for i in range(12)]
    created = await queue.create_batch(lines, endpoint="/v1/chat/completions", metadata={"via": "client"})
    assert created["status"] == "validating" and created["metadata"] == {"via": "client"}
    assert created["id"] in [b["id"] for b in await queue.batches()]
    async with asyncio.timeout(120):
        while (b := await queue.batch(created["id"]))["status"] != "completed":
            await asyncio.sleep(0.3)
    out, err = await queue.batch_results(b["id"])
    assert not err and sorted(o["custom_id"] for o in out) == sorted(f"q{i}" for i in range(12))
    with pytest.raises(BadRequest, match="cannot be cancelled"):
        await queue.cancel_batch(b["id"])
    async with Client(config=queue.config, tenant="someone-else") as other:
        with pytest.raises(NotFound):
            await other.batch(b["id"])


def mlxq_batches(d: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLXQ_REDIS_URL": d.redis.url, "MLXQ_PREFIX": PREFIX}
    return subprocess.run([sys.executable, "-m", "mlxq.api.cli", "batches", *args], env=env, capture_output=True,
                          text=True, timeout=60)


async def test_mlxq_batches_creates_shows_and_prints_results(served: tuple[Deployment, ServedGateway],
                                                            tmp_path: Path) -> None:
    d, _ = served
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"m{i}", PROMPTS[i % 8]) for i in range(6)]))
    made = await asyncio.to_thread(mlxq_batches, d, "--json", "create", str(path))
    assert made.returncode == 0, made.stderr
    bid = json.loads(made.stdout)["id"]
    async with asyncio.timeout(120):
        while "completed" not in (shown := await asyncio.to_thread(mlxq_batches, d, "show", bid)).stdout:
            await asyncio.sleep(0.3)
    assert "6/6 done, 0 failed" in shown.stdout
    listed = await asyncio.to_thread(mlxq_batches, d, "list")
    assert bid in listed.stdout
    results = await asyncio.to_thread(mlxq_batches, d, "results", bid)
    assert sorted(json.loads(line)["custom_id"] for line in results.stdout.splitlines()) == [f"m{i}" for i in range(6)]
    missing = await asyncio.to_thread(mlxq_batches, d, "show", "batch_nope")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no batch" in missing.stderr
