"""The gateway's every error path, its models and health routes, keys, limits and the ``mlxq gateway`` command:
a real gateway, a real Redis and real worker processes on the tiny model, with the official SDKs as clients.

Each API answers in its own error format and status: invalid 400, bad key 401, unknown model 404 (no live
worker for a known one 503), body too large 413, queue full 429 with Retry-After, a job's error 500/503 with
the job's error code. Never a traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.errors import NoWorker
from mlxq.api.gateway import GatewayConfig
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import ModelState, ModelStatus, WorkerStatus, image_data_url
from mlxq.worker.tools.redis_server import RedisServer
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, deployment, post

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    # A second worker whose jobs all run past their deadline: the job errors' path.
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-http")) as (d, gw):
        d.worker("hasty", MLXQ_JOB_TIMEOUT="0.05")
        yield d, gw


@pytest.fixture
def d(served: tuple[Deployment, ServedGateway]) -> Deployment:
    return served[0]


@pytest.fixture
def gw(served: tuple[Deployment, ServedGateway]) -> ServedGateway:
    return served[1]


@pytest.fixture
async def oai(gw: ServedGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def claude(gw: ServedGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0) as c:
        yield c


def openai_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in body["error"]["message"]
    return dict(body["error"])


def anthropic_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
    assert "Traceback" not in body["error"]["message"]
    return dict(body["error"])


async def write_health_record(d: Deployment, worker_id: str, model: str, state: ModelState) -> None:
    """A worker's health record as a worker writes it, for a worker that is gone (crashed, or its engine died)."""
    now = time.time()
    status = WorkerStatus(id=worker_id, host="elsewhere", pid=1, version="0", started_at=now, updated_at=now,
                          models=[ModelStatus(name=model, state=state, capacity=1, error="engine died")])
    keys = Keys(PREFIX)
    r = aredis.Redis.from_url(d.redis.url)
    try:
        await r.set(keys.worker(worker_id), status.model_dump_json(), ex=60)
        await r.zadd(keys.workers(), {worker_id: int(now * 1000)})
    finally:
        await r.aclose()


# --- models and health --------------------------------------------------------------------------------
async def test_models_lists_what_live_workers_serve_in_either_apis_format(oai: openai.AsyncOpenAI,
                                                                         claude: anthropic.AsyncAnthropic,
                                                                         d: Deployment) -> None:
    await write_health_record(d, "dead-one", "broken", ModelState.DEAD)  # known, no live worker: not listed
    listed = [m async for m in oai.models.list()]
    assert [m.id for m in listed] == ["hasty", "tiny"]
    assert all(m.owned_by == "mlxq" and m.model_extra and m.model_extra["workers"] == 1 for m in listed)
    assert listed[1].model_extra and listed[1].model_extra["context_length"] == 512
    assert (await oai.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        await oai.models.retrieve("broken")
    page = await claude.models.list()  # the SDK sends anthropic-version: Anthropic's format
    assert [m.id for m in page.data] == ["hasty", "tiny"] and page.data[0].type == "model"


async def test_health_is_ready_only_while_redis_answers(tmp_path: Path) -> None:
    from mlxq.api.config import ClientConfig
    from mlxq.api.gateway import GatewayConfig, create_app

    server = RedisServer().start()
    config = GatewayConfig(client=ClientConfig(redis_url=server.url, prefix=PREFIX, retry_deadline_s=0.5))
    gateway = ServedGateway(create_app(config)).start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            ok = await http.get("/health")
            assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
            server.close()
            gone = await http.get("/health")
            assert gone.status_code == 503 and gone.json()["status"] == "unavailable"
            assert "did not answer" in gone.json()["error"]
            models = await http.get("/v1/models")  # what needs Redis says so in the API's format
            assert models.status_code == 503 and openai_error(models)["code"] == "queue_unavailable"
    finally:
        gateway.stop()
        server.close()


# --- 400 ------------------------------------------------------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(("messages", "extra", "says"), [
    (USER, {"n": 9}, "n: Input should be less than or equal to 8"),
    (USER, {"top_logprobs": 2}, "top_logprobs without logprobs"),
    (USER, {"functions": [{"name": "f"}]}, "functions and function_call (use tools and tool_choice)"),
    (USER, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a JSON schema of an object"),
    (USER, {"response_format": {"type": "json_schema"}}, "response_format"),
    (USER, {"temperature": 3}, "temperature"),
    (USER, {"frobnicate": 1}, "frobnicate: Extra inputs are not permitted"),
    ([], {}, "messages: List should have at least 1 item"),
    (USER, {"seed": -1}, "seed"),
])
async def test_chat_requests_the_gateway_refuses_are_400s_that_say_why(
        oai: openai.AsyncOpenAI, messages: list[Any], extra: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.chat.completions.create(model="tiny", messages=messages, extra_body=extra)
    assert says in caught.value.message and caught.value.type == "invalid_request_error"


@pytest.mark.parametrize(("extra", "says"), [
    ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"),
])
async def test_completion_requests_the_gateway_refuses_are_400s_that_say_why(
        oai: openai.AsyncOpenAI, extra: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.completions.create(model="tiny", prompt="hi", max_tokens=4, **extra)
    assert caught.value.type == "invalid_request_error" and caught.value.code == "unsupported_parameter"
    assert f"not supported by this server: {says}" in caught.value.message


async def test_completion_and_malformed_requests_are_400s(gw: ServedGateway) -> None:
    refused = await post(gw.url, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]})
    assert refused.status_code == 400 and "token ids" in openai_error(refused)["message"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = await post(gw.url, path, None, content=b"{not json")
        assert resp.status_code == 400 and openai_error(resp)["code"] == "invalid_request"
    missing = await post(gw.url, "/v1/chat/completions", {"model": "tiny"})
    assert missing.status_code == 400 and "messages: Field required" in openai_error(missing)["message"]
    resp = await post(gw.url, "/v1/messages", None, content=b"[]")
    assert resp.status_code == 400 and anthropic_error(resp)["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools (bash_20250124)"),
    ({"messages": USER, "thinking": {"type": "adaptive"}}, "thinking"),
    ({"messages": []}, "messages"),
])
async def test_messages_the_gateway_refuses_are_400s_that_say_why(claude: anthropic.AsyncAnthropic,
                                                                  body: dict[str, Any], says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(model="tiny", max_tokens=8, **body)
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and says in error["message"]


async def test_images_for_a_text_only_model_are_refused_by_its_worker(oai: openai.AsyncOpenAI,
                                                                    claude: anthropic.AsyncAnthropic) -> None:
    # The gateway passes image parts on as the job's; the worker of a model that takes none refuses the job.
    refusal = "the model 'tiny' does not accept images (a text-only model)"
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [IMAGE]}])
    assert caught.value.code == "bad_request" and refusal in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["code"] == "bad_request" and refusal in error["message"]


async def test_the_gateway_checks_jobs_against_the_workers_limits_it_is_given(d: Deployment) -> None:
    # MLXQ_MAX_PAYLOAD_BYTES, MLXQ_MAX_IMAGES and MLXQ_MAX_IMAGE_BYTES, read as the workers read them: a job
    # within them goes on to the worker (a text-only one, which refuses images), a larger one is refused here.
    env = {"MLXQ_MAX_PAYLOAD_BYTES": "2000", "MLXQ_MAX_IMAGES": "1", "MLXQ_MAX_IMAGE_BYTES": "3000"}
    limits = GatewayConfig.from_env(env).client
    with d.gateway(client={"max_payload_bytes": limits.max_payload_bytes, "max_images": limits.max_images,
                           "max_image_bytes": limits.max_image_bytes}) as small:
        async with openai.AsyncOpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0) as oai:
            for size, says in ((2900, "does not accept images"), (6000, f"the limit is {limits.max_job_bytes}")):
                url = image_data_url(bytes(size))
                with pytest.raises(openai.BadRequestError) as caught:
                    await oai.chat.completions.create(model="tiny", max_tokens=4, messages=[
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
                assert says in caught.value.message


async def test_what_only_the_worker_can_judge_is_a_400_with_its_code(oai: openai.AsyncOpenAI,
                                                                     claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.completions.create(model="tiny", prompt="hi", max_tokens=600, stream=True)
    assert caught.value.code == "bad_request" and "exceeds the context (512)" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model="tiny", max_tokens=600, messages=USER)  # type: ignore[arg-type]
    assert refused.value.body["error"]["code"] == "bad_request"  # type: ignore[index]


# --- 401 ------------------------------------------------------------------------------------------------
async def test_keys_are_required_when_configured_as_bearer_or_x_api_key(d: Deployment) -> None:
    with d.gateway(api_keys=frozenset({"k1", "k2"})) as locked:
        for key, works in (("k2", True), ("wrong", False)):
            async with openai.AsyncOpenAI(base_url=f"{locked.url}/v1", api_key=key, max_retries=0) as oai:
                if works:
                    resp = await oai.completions.create(model="tiny", prompt="hi", max_tokens=2)
                    assert resp.usage is not None and resp.usage.completion_tokens == 2
                    assert [m.id async for m in oai.models.list()] == ["hasty", "tiny"]
                else:
                    with pytest.raises(openai.AuthenticationError) as caught:
                        await oai.completions.create(model="tiny", prompt="hi", max_tokens=2)
                    assert caught.value.code == "invalid_api_key"
        async with anthropic.AsyncAnthropic(base_url=locked.url, api_key="k1", max_retries=0) as claude:
            msg = await claude.messages.create(model="tiny", max_tokens=2, messages=USER)  # type: ignore[arg-type]
            assert msg.usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(base_url=locked.url, api_key="nope", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await claude.messages.create(model="tiny", max_tokens=2, messages=USER)  # type: ignore[arg-type]
            assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        missing = await post(locked.url, "/v1/chat/completions", {"model": "tiny", "messages": USER})
        assert missing.status_code == 401 and openai_error(missing)["code"] == "missing_api_key"
        async with httpx.AsyncClient(base_url=locked.url) as http:
            assert (await http.get("/health")).status_code == 200  # probes need no key


async def test_a_keys_tenant_owns_its_requests_jobs_and_the_user_field_never_chooses(d: Deployment) -> None:
    keys = Keys(PREFIX)
    r = aredis.Redis.from_url(d.redis.url)
    try:
        with d.gateway(api_keys=frozenset({"k1=acme", "k2", "pad=="})) as locked:
            tenants_of = {}
            for key in ("k1", "k2", "pad=="):
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "globex"}
                resp = await post(locked.url, "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
                assert resp.status_code == 200
                async with Client(d.redis.url, prefix=PREFIX) as c:
                    tenants_of[key] = (await c.result(resp.headers["x-mlxq-job-id"], timeout=30)).tenant
            assert tenants_of == {"k1": "acme", "k2": "default", "pad==": "default"}
            # acme at its max-queued (a job parked far in the future): its requests are 429 with Retry-After
            await r.hset(keys.tenant("acme"), "max_queued", 1)  # type: ignore[misc]
            await r.zadd(keys.queue("tiny", "acme"), {"parked": 10**15})
            full = await post(locked.url, "/v1/chat/completions", {"model": "tiny", "messages": USER},
                              headers={"Authorization": "Bearer k1"})
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            assert openai_error(full)["code"] == "queue_full" and "acme" in openai_error(full)["message"]
            other = await post(locked.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                               headers={"Authorization": "Bearer k2"})
            assert other.status_code == 200
    finally:
        await r.delete(Keys(PREFIX).tenant("acme"), Keys(PREFIX).queue("tiny", "acme"))
        await r.aclose()


# --- 404 and 503: no live worker -------------------------------------------------------------------------
async def test_an_unknown_model_is_a_404_naming_the_models_served(oai: openai.AsyncOpenAI,
                                                                  claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.chat.completions.create(model="ghost", messages=USER, stream=True)  # type: ignore[call-overload]
    assert caught.value.code == "model_not_found" and "'hasty', 'tiny'" in caught.value.message
    assert "x-mlxq-job-id" not in caught.value.response.headers  # refused: no job was queued
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude.messages.create(model="ghost", max_tokens=4, messages=USER)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_a_known_model_without_a_live_worker_is_a_503(oai: openai.AsyncOpenAI,
                                                            claude: anthropic.AsyncAnthropic, d: Deployment) -> None:
    await write_health_record(d, "dead-one", "broken", ModelState.DEAD)
    with pytest.raises(openai.InternalServerError) as caught:
        await oai.chat.completions.create(model="broken", messages=USER)  # type: ignore[arg-type]
    assert caught.value.status_code == 503 and caught.value.code == "no_live_worker"
    with pytest.raises(anthropic.InternalServerError) as overloaded:
        await claude.messages.create(model="broken", max_tokens=4, messages=USER)  # type: ignore[arg-type]
    assert overloaded.value.status_code == 503
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


# --- 413 ------------------------------------------------------------------------------------------------
async def test_a_body_over_the_limit_is_a_413_declared_or_streamed(d: Deployment) -> None:
    with d.gateway(max_body_bytes=2000) as small:
        big = {"model": "tiny", "prompt": "x" * 3000}
        declared = await post(small.url, "/v1/completions", big)
        assert declared.status_code == 413 and openai_error(declared)["code"] == "request_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "'
            for _ in range(30):
                yield b"y" * 100
            yield b'"}]}'

        async with httpx.AsyncClient(base_url=small.url) as http:
            streamed = await http.post("/v1/messages", content=chunks())
        assert streamed.status_code == 413 and anthropic_error(streamed)["type"] == "request_too_large"
        fits = await post(small.url, "/v1/completions", {"model": "tiny", "prompt": "x" * 100, "max_tokens": 2})
        assert fits.status_code == 200


# --- 429 ------------------------------------------------------------------------------------------------
async def test_a_full_queue_is_a_429_with_retry_after(d: Deployment) -> None:
    # Jobs wait in the queue until a worker takes them: a model whose worker takes none holds them.
    await write_health_record(d, "stuck", "idle", ModelState.SERVING)
    async with Client(config=d.config.client) as queue:
        await queue.submit(model="idle", prompt="waiting", expires_in=30)
    with d.gateway(client={"max_queued": 1}) as capped:
        async with openai.AsyncOpenAI(base_url=f"{capped.url}/v1", api_key="-", max_retries=0) as oai:
            with pytest.raises(openai.RateLimitError) as caught:
                await oai.completions.create(model="idle", prompt="one too many", max_tokens=4)
            assert caught.value.code == "queue_full" and caught.value.response.headers["retry-after"] == "1"
            resp = await oai.completions.create(model="tiny", prompt="another queue", max_tokens=2)
            assert resp.usage is not None and resp.usage.completion_tokens == 2  # the cap is per model
        async with anthropic.AsyncAnthropic(base_url=capped.url, api_key="-", max_retries=0) as claude:
            with pytest.raises(anthropic.RateLimitError) as limited:
                await claude.messages.create(model="idle", max_tokens=4, messages=USER)  # type: ignore[arg-type]
            assert limited.value.response.headers["retry-after"] == "1"
            assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


# --- 500 and 503 from a job's error ------------------------------------------------------------------------
async def test_a_job_past_its_deadline_is_a_500_with_its_code_whole_or_streamed(
        oai: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        await oai.completions.create(model="hasty", prompt="hi", max_tokens=400)
    assert caught.value.status_code == 500 and caught.value.code == "timeout"
    assert caught.value.response.headers["x-mlxq-job-id"]  # it ran: its id says which job to look at
    with pytest.raises(openai.APIError) as streamed:  # the stream may have started: an error event, same code
        async for _ in await oai.chat.completions.create(model="hasty", messages=USER, max_tokens=400,  # type: ignore[arg-type]
                                                         stream=True):
            pass
    assert streamed.value.code == "timeout"
    with pytest.raises(anthropic.APIStatusError) as failed:
        async for _ in await claude.messages.create(model="hasty", max_tokens=400, messages=USER,  # type: ignore[arg-type]
                                                    stream=True):
            pass
    assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert failed.value.body["error"]["code"] == "timeout"  # type: ignore[index]


async def test_a_job_nobody_took_before_its_expiry_is_a_503_expired(d: Deployment) -> None:
    # The record of a worker that died a moment ago lets the job in; no worker takes it, and a live worker's
    # reaper ends it at its expiry.
    await write_health_record(d, "just-died", "sleepy", ModelState.SERVING)
    with d.gateway(client={"job_expiry_s": 0.3}) as gateway:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0) as oai:
            with pytest.raises(openai.InternalServerError) as caught:
                await oai.completions.create(model="sleepy", prompt="hi", max_tokens=4)
    assert caught.value.status_code == 503 and caught.value.code == "expired"


async def test_unknown_routes_and_methods_answer_in_json(gw: ServedGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        assert openai_error(await http.get("/v1/nothing"))["code"] == "unknown_route"
        wrong = await http.get("/v1/chat/completions")
        assert wrong.status_code == 405 and openai_error(wrong)["type"] == "invalid_request_error"


async def test_a_burst_of_requests_reads_the_workers_health_records_once(d: Deployment,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The gateway's queue client checks that a live worker serves the model before it queues a job; requests
    # that arrive together share one read of the records (each would cost Redis reads and parsing).
    import mlxq.api.client

    reads = 0
    real = mlxq.api.client.live_workers

    async def counted(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        return await real(*args)

    monkeypatch.setattr(mlxq.api.client, "live_workers", counted)
    async with Client(config=d.config.client) as queue:
        rids = await asyncio.gather(*(queue.submit(model="tiny", prompt="hi", max_tokens=1, require_worker=True)
                                      for _ in range(16)))
        with pytest.raises(NoWorker):
            await queue.submit(model="ghost", prompt="hi", require_worker=True)
        results = [await queue.result(rid, timeout=60) for rid in rids]
    assert len(set(rids)) == 16 and all(r.usage.completion_tokens == 1 for r in results)
    assert reads == 2  # one for the burst, one for the unknown model


# --- the command ------------------------------------------------------------------------------------------
async def test_mlxq_gateway_serves_until_sigterm(d: Deployment) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLXQ_REDIS_URL": d.redis.url, "MLXQ_PREFIX": PREFIX}
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.api.cli", "gateway", "--port", str(port), "--log-level",
                             "debug"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            for _ in range(300):
                try:
                    resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down cleanly, then re-raises the signal it caught: the process ends as SIGTERM asked.
    assert proc.returncode in (0, -signal.SIGTERM), out.decode()
    assert b"Application shutdown complete" in out and b"Traceback" not in out
    log = out.decode()
    assert f"INFO mlxq.api.gateway.app: gateway serving the queue at {d.redis.url} (prefix {PREFIX}" in log
    (line,) = [x for x in log.splitlines() if "POST /v1/completions" in x]  # one line per request, at DEBUG
    assert "DEBUG mlxq.api.gateway.app:" in line and "model tiny -> 200: 3 tokens, length" in line


def test_mlxq_gateway_without_the_extra_says_so_in_one_line() -> None:
    code = ("import sys; sys.modules['uvicorn'] = None; "  # as if the gateway extra were not installed
            "from mlxq.api.cli import main; sys.exit(main(['gateway']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "pip install 'mlxq[gateway]'" in proc.stderr


async def test_a_client_can_follow_a_job_the_gateway_ran(oai: openai.AsyncOpenAI, d: Deployment) -> None:
    # The response's id names the queue's job: its events stay readable through the client library.
    resp = await oai.completions.create(model="tiny", prompt="hi", max_tokens=5)
    async with Client(config=d.config.client) as queue:
        result = await queue.result(resp.id.removeprefix("cmpl-"), timeout=30)
    assert result.text == resp.choices[0].text
