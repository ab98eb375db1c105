"""The client's one retry policy (api/connection.py) against private real Redis servers: refusals raise at once
(AccessDenied), an unreachable Redis is retried until the deadline (QueueUnavailable), a blip is ridden out."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import AuthenticationError, BusyLoadingError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mlxq.api.client import Client
from mlxq.api.connection import is_denied, is_transient, redact
from mlxq.api.errors import AccessDenied, QueueUnavailable
from mlxq.api.protocol.keys import Keys, log_entry_id
from mlxq.api.schema import DoneEvent, FinishReason, StartEvent, Timings, Usage
from mlxq.worker.tools.redis_server import RedisServer, find_redis_server
from tests.peers import PEERS, silent_peer
from tests.support import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[int]:
    """A private redis-server with a password, and an ACL user that may not read streams."""
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        admin = redis.Redis(port=port, password="s3cret")
        for _ in range(500):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                threading.Event().wait(0.02)
        admin.acl_setuser("noxrange", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all", "-xrange"])
        admin.close()
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("url", ["redis://:wrong@127.0.0.1:{port}", "redis://127.0.0.1:{port}"],
                         ids=["wrong_password", "no_password"])
async def test_refused_credentials_raise_access_denied_at_once(secured: int, url: str) -> None:
    async with Client(url.format(port=secured), retry_deadline=60) as client:  # a retry would hang the test
        with pytest.raises(AccessDenied) as submit:
            await client.submit(model="m", prompt="hi")
        with pytest.raises(AccessDenied):
            await client.result("some-job", timeout=60)  # not a WaitTimeout, not a retry for ever
        with pytest.raises(AccessDenied):
            await anext(aiter(client.events("some-job")))
        with pytest.raises(AccessDenied):
            await client.cancel("some-job")
    message = str(submit.value)
    assert f"127.0.0.1:{secured}" in message and "refused the credentials" in message
    assert "wrong" not in message


async def test_a_refused_command_raises_access_denied_naming_it(secured: int) -> None:
    async with Client(f"redis://noxrange:pw@127.0.0.1:{secured}", retry_deadline=60) as client:
        rid = await client.submit(model="m", prompt="hi")  # allowed
        with pytest.raises(AccessDenied) as follow:
            await client.result(rid, timeout=60)
    assert "refused a command" in str(follow.value) and "xrange" in str(follow.value)
    assert ":pw@" not in str(follow.value)


async def test_a_submit_made_while_redis_is_down_goes_through_when_it_returns(tmp_path: Path) -> None:
    server = RedisServer(tcp=True, directory=str(tmp_path / "r")).start()
    try:
        server.stop()
        restart = threading.Timer(0.5, server.start)
        restart.start()
        async with Client(server.url, retry_deadline=30) as client:
            rid = await client.submit(model="m", prompt="hi")
        restart.join()
        r = redis.Redis.from_url(server.url)
        assert r.zrange(Keys().queue("m"), 0, -1) == [rid.encode()]  # once, though it was sent again
        r.close()
    finally:
        server.close()


async def test_a_follower_rides_out_a_redis_restart_and_gives_up_on_an_outage(tmp_path: Path) -> None:
    server = RedisServer(tcp=True, appendonly=True, directory=str(tmp_path / "r")).start()
    keys = Keys()
    try:
        async with Client(server.url, retry_deadline=1.0) as client:
            start = StartEvent(id="j", seq=0, model="m", worker="w", prompt_tokens=1)
            end = DoneEvent(id="j", seq=1, finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=1,
                            completion_tokens=0), timings=Timings(queue_ms=0, ttft_ms=None, total_ms=1,
                                                                  tokens_per_s=None))
            write(server.url, keys, start)
            events = client.events("j", timeout=60)
            assert await anext(events) == start
            await asyncio.to_thread(server.restart)  # within the deadline: the follower reconnects
            write(server.url, keys, end)
            assert await anext(events) == end
            await events.aclose()

            follower = client.events("k", timeout=60)
            write(server.url, keys, start.model_copy(update={"id": "k"}))
            await anext(follower)
            await asyncio.to_thread(server.stop)  # for good: past the deadline the follower gives up
            with pytest.raises(QueueUnavailable) as gone:
                await anext(follower)
            assert "unreachable" in str(gone.value)
    finally:
        server.close()


@pytest.mark.parametrize("kind", PEERS)
async def test_a_peer_that_never_answers_ends_each_operation_at_its_deadline(kind: str) -> None:
    # No socket timeout bounds a reply that never comes (and a connect timeout may outlast the deadline): the
    # operation's deadline does, and the message names it.
    with silent_peer(kind) as url:
        async with Client(url, retry_deadline=0.3) as client:  # its close ends too (the enqueuer's send is dropped)
            operations = {"workers": client.workers, "cancel": lambda: client.cancel("j"),
                          "submit": lambda: client.submit(model="m", prompt="hi")}
            for name, op in operations.items():
                with pytest.raises(QueueUnavailable) as gone:
                    await op()
                message = str(gone.value)
                assert message.startswith(f"Redis at {url} unreachable within the 0.3s deadline "
                                          "(MLXQ_RETRY_DEADLINE; "), (name, message)
                assert message.split("): ", 1)[1], (name, message)  # and the cause


def write(url: str, keys: Keys, event: Any) -> None:
    r = redis.Redis.from_url(url)
    r.xadd(keys.log(event.id), {"e": event.model_dump_json()}, id=log_entry_id(event.seq))
    r.publish(keys.events(event.id), event.model_dump_json())
    r.close()


def test_errors_are_classified_as_refusals_or_transient() -> None:
    refused = [AuthenticationError("invalid password"), NoPermissionError("NOPERM no permissions"),
               ResponseError("NOAUTH Authentication required."), ResponseError("WRONGPASS invalid username")]
    transient = [RedisConnectionError("Error 111"), RedisTimeoutError("timed out"), OSError("reset"),
                 BusyLoadingError("loading")]
    assert [is_denied(e) for e in refused] == [True] * 4
    assert [is_transient(e) for e in refused] == [False] * 4
    assert [is_transient(e) and not is_denied(e) for e in transient] == [True] * 4
    assert not is_transient(ResponseError("WRONGTYPE")) and not is_denied(ResponseError("WRONGTYPE"))


def test_addresses_in_messages_carry_no_password() -> None:
    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://:s3cret@host:6379") == "redis://:***@host:6379"
    assert redact("unix:///tmp/r.sock?password=s3cret") == "unix:///tmp/r.sock"


def test_redis_7s_answer_to_a_large_unauthenticated_request_is_access_denied() -> None:
    # Redis 7 answers a client that has not authenticated and sends a long multibulk (a pipelined enqueue) with
    # this error instead of NOAUTH; retrying would repeat it.
    from redis.exceptions import ResponseError

    from mlxq.api.connection import denied, is_denied, is_transient

    exc = ResponseError("Protocol error: unauthenticated multibulk length")
    assert is_denied(exc) and not is_transient(exc)
    message = str(denied(exc, "redis://127.0.0.1:6379"))
    assert "requires a password and none was given" in message and "redis://:PASSWORD@host" in message
