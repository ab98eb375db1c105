"""Webhooks: a real Redis, a real worker on the tiny model, real gateways (uvicorn), a receiver on loopback (the
stdlib's http.server) and the official openai SDK verifying what it receives. A background response's end is
sent once, in OpenAI's format, signed per Standard Webhooks; retried with the same webhook-id; delivered once by
one of several gateways; taken over from a gateway that died holding it; a receiver down past the schedule is
recorded as failed. A bad secret or URL stops the gateway at its start in one line."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aredis

from mlxq.api.errors import ConfigError
from mlxq.api.gateway.config import GatewayConfig
from mlxq.api.gateway.webhooks import GROUP
from mlxq.api.protocol.keys import Keys
from mlxq.api.protocol.notify import publish, report
from mlxq.api.status import Report, render
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway, deployment, occupy, release

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent.parent
SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
KEYS = Keys(PREFIX)
FAST = {"webhook_schedule": (0.0, 0.2, 0.2), "webhook_claim_s": 1.0}  # short schedules for tests


class Receiver:
    """A webhook endpoint on loopback: records each delivery (headers, body); answers ``statuses`` in turn, then
    200."""

    def __init__(self, statuses: tuple[int, ...] = ()) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.statuses = list(statuses)
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer.lock:
                    outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    status = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    async def wait(self, n: int) -> list[tuple[dict[str, str], bytes]]:
        """Once ``n`` deliveries came."""
        for _ in range(1200):
            if len(self.got) >= n:
                return list(self.got)
            await asyncio.sleep(0.05)
        raise AssertionError(f"{len(self.got)} deliveries of {n}")


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    with deployment(tiny_model, tmp_path_factory.mktemp("gw-webhooks")) as running:
        yield running


@pytest.fixture
def d(served: tuple[Deployment, ServedGateway]) -> Deployment:
    return served[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


async def r_of(d: Deployment) -> aredis.Redis:
    return aredis.Redis.from_url(d.redis.url)


async def settled_stream(d: Deployment) -> None:
    """Once every event of the stream was delivered (acknowledged and dropped)."""
    r = await r_of(d)
    try:
        for _ in range(1200):
            if await r.xlen(KEYS.webhooks()) == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("events still waiting in the stream")
    finally:
        await r.aclose()


def unwrap(headers: dict[str, str], body: bytes) -> Any:
    return openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=SECRET)


async def test_a_background_responses_end_is_posted_once_signed_so_the_openai_sdk_verifies_it(
        d: Deployment, receiver: Receiver) -> None:
    with d.gateway(webhook_urls=(receiver.url,), webhook_secret=SECRET, **FAST) as gw:
        oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
        resp = await oai.responses.create(model="tiny", input="hook me", max_output_tokens=8, background=True)
        ((headers, body),) = await receiver.wait(1)
        event = unwrap(headers, body)
        assert event.type in ("response.completed", "response.incomplete") and event.data.id == resp.id
        assert event.object == "event" and event.id == headers["webhook-id"] and event.id.startswith("evt_")
        assert abs(event.created_at - time.time()) < 600
        got = await oai.responses.retrieve(resp.id)  # what the receiver does next: settled already
        assert got.status == event.type.removeprefix("response.") and got.output_text
        with pytest.raises(openai.InvalidWebhookSignatureError):
            openai.OpenAI(api_key="unused").webhooks.unwrap(body + b" ", headers, secret=SECRET)
        await settled_stream(d)
    assert len(receiver.got) == 1


async def test_a_cancelled_background_response_sends_response_cancelled(d: Deployment, receiver: Receiver) -> None:
    with d.gateway(webhook_urls=(receiver.url,), webhook_secret=SECRET, **FAST) as gw:
        oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
        resp = await oai.responses.create(model="tiny", input="long", max_output_tokens=400, background=True)
        await oai.responses.cancel(resp.id)
        ((headers, body),) = await receiver.wait(1)
        assert unwrap(headers, body).type == "response.cancelled"


async def test_a_receiver_failing_twice_gets_the_third_attempt_with_the_same_webhook_id(d: Deployment) -> None:
    receiver = Receiver(statuses=(500, 503))
    try:
        with d.gateway(webhook_urls=(receiver.url,), webhook_secret=SECRET, **FAST):
            r = await r_of(d)
            await publish(r, KEYS, "batch.completed", "batch_abc", "default")  # batches' way in: the same stream
            got = await receiver.wait(3)
            await settled_stream(d)
            counts = (await report(r, KEYS))["counts"]
            await r.aclose()
        assert len({h["webhook-id"] for h, _ in got}) == 1 and len(got) == 3
        assert [unwrap(h, b).type for h, b in got] == ["batch.completed"] * 3
        assert counts["delivered"] >= 1 and counts["retried"] >= 2
    finally:
        receiver.close()


async def test_a_receiver_down_past_the_schedule_is_recorded_as_failed(d: Deployment) -> None:
    receiver = Receiver(statuses=(500, 500, 500))
    try:
        with d.gateway(webhook_urls=(receiver.url,), webhook_secret=SECRET, **FAST):
            r = await r_of(d)
            await r.delete(KEYS.webhook_failures())
            await publish(r, KEYS, "batch.failed", "batch_down", "default")
            await receiver.wait(3)
            await settled_stream(d)
            failures = (await report(r, KEYS))["failures"]
            await r.aclose()
        assert failures[0]["id"] == "batch_down" and failures[0]["error"] == "HTTP 500"
        assert failures[0]["url"] == receiver.url and failures[0]["attempts"] == 3
    finally:
        receiver.close()


async def test_two_gateways_deliver_each_event_once(d: Deployment, receiver: Receiver) -> None:
    hooks = {"webhook_urls": (receiver.url,), "webhook_secret": SECRET, **FAST}
    with d.gateway(**hooks), d.gateway(**hooks):
        r = await r_of(d)
        for i in range(20):
            await publish(r, KEYS, "batch.completed", f"batch_{i}", "default")
        got = await receiver.wait(20)
        await settled_stream(d)
        await r.aclose()
    ids = [h["webhook-id"] for h, _ in receiver.got]
    assert len(got) == 20 and len(ids) == len(set(ids)) == 20


async def test_an_endpoint_that_answered_410_gets_nothing_more_from_any_gateway_and_status_says_so(
        d: Deployment, receiver: Receiver) -> None:
    gone = Receiver(statuses=(410,) * 40)
    hooks = {"webhook_urls": (gone.url, receiver.url), "webhook_secret": SECRET, **FAST}
    r = await r_of(d)
    try:
        await r.delete(KEYS.webhook_disabled())
        with d.gateway(**hooks), d.gateway(**hooks):
            await publish(r, KEYS, "batch.completed", "batch_first", "default")
            await receiver.wait(1)
            await settled_stream(d)  # its 410 was recorded before the event was acknowledged
            for i in range(20):  # each gateway delivers some of them: neither sends any to the gone endpoint
                await publish(r, KEYS, "batch.completed", f"batch_after_{i}", "default")
            await receiver.wait(21)
            await settled_stream(d)
        hooks_report = await report(r, KEYS)
    finally:
        gone.close()
        await r.aclose()
    assert len(gone.got) == 1 and len(receiver.got) == 21
    assert [e["url"] for e in hooks_report["disabled"]] == [gone.url]
    text = render(Report("redis", PREFIX, time.time(), {}, {}, [], [], webhooks=hooks_report))
    assert f"disabled: {gone.url} answered 410 Gone" in text


async def test_an_event_a_dead_gateway_held_is_delivered_by_another(d: Deployment, receiver: Receiver) -> None:
    r = await r_of(d)
    try:
        with contextlib.suppress(aredis.ResponseError):  # made by an earlier gateway
            await r.xgroup_create(KEYS.webhooks(), GROUP, id="0", mkstream=True)
        await publish(r, KEYS, "batch.expired", "batch_orphan", "default")
        # A gateway reads it (XREADGROUP: pending, its own) and dies before delivering it.
        taken = await r.xreadgroup(GROUP, "dead-gateway", {KEYS.webhooks(): ">"}, count=10)
        assert taken and len(taken[0][1]) == 1
        with d.gateway(webhook_urls=(receiver.url,), webhook_secret=SECRET, **FAST):
            ((headers, body),) = await receiver.wait(1)
            await settled_stream(d)
        event = unwrap(headers, body)
        assert (event.type, event.data.id) == ("batch.expired", "batch_orphan")
        assert (await r.xpending(KEYS.webhooks(), GROUP))["pending"] == 0
    finally:
        await r.aclose()


async def test_a_response_that_ended_while_no_gateway_was_up_is_settled_and_sent_when_one_starts(
        d: Deployment, receiver: Receiver) -> None:
    hooks = {"webhook_urls": (receiver.url,), "webhook_secret": SECRET, **FAST}
    r = await r_of(d)
    try:
        fillers = await occupy(d)  # its job waits queued behind them while its gateway stops
        with d.gateway(**hooks) as gw:  # it answers at once, and stops before its job runs
            oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
            resp = await oai.responses.create(model="tiny", input="while away", max_output_tokens=400,
                                              background=True)
        await release(d, fillers)
        job = resp.id.removeprefix("resp_")
        while await r.exists(KEYS.job(job)):  # its job ends with no gateway up
            await asyncio.sleep(0.05)
        assert (await r.hget(KEYS.response(job), "status")) in (b"queued", b"in_progress")  # nobody recorded it
        assert receiver.got == [] and await r.xlen(KEYS.webhooks()) == 1  # EMIT put its event on the stream
        with d.gateway(**hooks):
            ((headers, body),) = await receiver.wait(1)
            assert unwrap(headers, body).data.id == resp.id
            fields = await r.hgetall(KEYS.response(job))
        assert fields[b"status"].decode() == unwrap(headers, body).type.removeprefix("response.")
        assert json.loads(fields[b"final"])["output"]  # settled, with its text, before the POST
    finally:
        await r.aclose()


@pytest.mark.parametrize(("env", "problem"), [
    ({"MLXQ_WEBHOOK_URL": "http://127.0.0.1:9/h", "MLXQ_WEBHOOK_SECRET": "nope"}, "starts with 'whsec_'"),
    ({"MLXQ_WEBHOOK_URL": "http://127.0.0.1:9/h", "MLXQ_WEBHOOK_SECRET": "whsec_!!"}, "not base64"),
    ({"MLXQ_WEBHOOK_URL": "http://127.0.0.1:9/h", "MLXQ_WEBHOOK_SECRET": "whsec_c2hvcnQ="}, "24 to 64 bytes"),
    ({"MLXQ_WEBHOOK_URL": "ftp://x/h", "MLXQ_WEBHOOK_SECRET": SECRET}, "not an http(s) URL"),
    ({"MLXQ_WEBHOOK_URL": "http://127.0.0.1:9/h"}, "set MLXQ_WEBHOOK_SECRET"),
])
def test_a_bad_webhook_secret_or_url_stops_the_gateway_at_its_start_in_one_line(env: dict[str, str],
                                                                                 problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        GatewayConfig.from_env(env)
    proc = subprocess.run([sys.executable, "-m", "mlxq.api.cli", "gateway", "--port", "0"], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and problem in proc.stderr, proc.stderr


def test_a_good_webhook_configuration_reads_back() -> None:
    config = GatewayConfig.from_env({"MLXQ_WEBHOOK_URL": "http://a/h, https://b/h", "MLXQ_WEBHOOK_SECRET": SECRET,
                                     "MLXQ_WEBHOOK_SCHEDULE": "0,1,2"})
    assert config.webhook_urls == ("http://a/h", "https://b/h") and config.webhook_schedule == (0.0, 1.0, 2.0)
    assert GatewayConfig.from_env({}).webhook_urls == ()  # unset: no webhooks
