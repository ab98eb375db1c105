"""Redis Sentinel: a worker and a client on a Sentinel set of real processes on loopback (a master, a replica,
three sentinels), through the master's death; and the one-line failures of a Sentinel URL that names no master."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from mlxq.api.client import Client
from mlxq.api.connection import find_master, sentinel_url
from mlxq.api.errors import AccessDenied, ConfigError, JobNotFound, MlxqError, QueueUnavailable
from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer, find_redis_server
from tests.redis_faults import MASTER, Node, SentinelSet
from tests.support import free_port, slow_steps, start_worker, terminal
from tests.worker.test_worker_cli import arq_worker_run, mlxq, one_line

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # real Redis processes of their own


def _sentinel(tmp_path: Path, master_port: int, extra: str = "") -> Node:
    """One sentinel on a free port watching, as MASTER, the Redis at ``master_port`` (``extra``: more of its
    configuration), answering pings."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n{extra}"
                    f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 1\n")
    node = Node(port, [find_redis_server(), str(conf), "--sentinel"])
    node.start()
    for _ in range(200):
        with contextlib.suppress(redis.RedisError, OSError):
            node.client().ping()
            break
        time.sleep(0.05)
    return node


@pytest.fixture(params=[""], ids=["open"])
def lone_sentinel(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """One sentinel watching, as MASTER, an address where nothing listens (with the password ``param``)."""
    dead = free_port()
    password = f"requirepass {request.param}\n" if request.param else ""
    node = _sentinel(tmp_path, dead, password)
    try:
        yield node, dead
    finally:
        node.kill()


def test_a_worker_whose_sentinels_never_answer_says_so_in_one_line_and_exits_78(tiny_model: Path) -> None:
    url = f"redis+sentinel://127.0.0.1:{free_port()}/{MASTER}"
    proc = arq_worker_run({"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": url, "MLXQ_CONNECT_DEADLINE": "0.7"})
    assert proc.returncode == 78, proc.stderr
    assert f"worker cannot start: no sentinel of {url} answered within 0.7s (MLXQ_CONNECT_DEADLINE): " \
           "no sentinel of 127.0.0.1:" in one_line(proc)


def test_a_master_name_no_sentinel_knows_is_one_line_and_exit_78(lone_sentinel: Any, tiny_model: Path) -> None:
    node, _ = lone_sentinel
    url = f"redis+sentinel://127.0.0.1:{node.port}/nosuchmaster"
    proc = arq_worker_run({"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": url, "MLXQ_CONNECT_DEADLINE": "5"})
    assert proc.returncode == 78, proc.stderr
    assert one_line(proc).endswith(f"worker cannot start: no sentinel of 127.0.0.1:{node.port} knows a master "
                                   "named 'nosuchmaster' (MLXQ_REDIS_URL)")


def test_a_master_that_refuses_connections_is_the_unreachable_error_naming_its_address(lone_sentinel: Any,
                                                                                        tiny_model: Path) -> None:
    node, dead = lone_sentinel
    url = f"redis+sentinel://127.0.0.1:{node.port}/{MASTER}"
    proc = arq_worker_run({"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": url, "MLXQ_CONNECT_DEADLINE": "0.7"})
    assert proc.returncode == 69, proc.stderr
    line = one_line(proc)
    assert f"worker cannot start: Redis at {url} unreachable within the 0.7s deadline" in line, line
    assert f"127.0.0.1:{dead}" in line, line

    async def submit() -> None:
        async with Client(url, retry_deadline=0.5) as client:
            await client.submit(model="tiny", prompt="hi")

    with pytest.raises(QueueUnavailable, match=f"unreachable within the 0.5s deadline .*127.0.0.1:{dead}"):
        asyncio.run(submit())


@pytest.mark.parametrize("lone_sentinel", ["s3cret"], ids=["password"], indirect=True)
async def test_the_sentinels_own_password_goes_in_the_query_string(lone_sentinel: Any) -> None:
    node, dead = lone_sentinel
    base = f"redis+sentinel://127.0.0.1:{node.port}/{MASTER}"
    assert await find_master(sentinel_url(f"{base}?sentinel_password=s3cret"), 2) == ("127.0.0.1", dead)
    for url in (base, f"{base}?sentinel_password=wrong"):
        with pytest.raises(AccessDenied, match=f"^Redis at sentinel 127.0.0.1:{node.port} refused "):
            await find_master(sentinel_url(url), 2)


async def test_a_plain_redis_named_as_a_sentinel_is_a_configuration_error() -> None:
    tcp = RedisServer(tcp=True).start()
    try:
        with pytest.raises(ConfigError, match=f"^127.0.0.1:{tcp.port} does not answer as a Redis Sentinel does"):
            await find_master(sentinel_url(f"redis+sentinel://127.0.0.1:{tcp.port}/{MASTER}"), 2)
    finally:
        tcp.stop()


async def _follow(client: Client, rid: str) -> list[Any] | str:
    try:
        return [ev async for ev in client.events(rid, timeout=45)]
    except JobNotFound:
        return "lost"


async def test_the_masters_death_mid_stream_ends_every_job_once(tmp_path: Path, tiny_model: Path) -> None:
    cluster = SentinelSet(tmp_path).start()
    try:
        config = WorkerConfig(model=str(tiny_model), model_name="tiny", redis_url=cluster.url, capacity=2,
                              poll_delay_s=0.25, cancel_poll_s=0.1, drain_timeout_s=5.0)
        running = await start_worker(config)
        full_speed = slow_steps(running, 0.04)
        async with Client(cluster.url, retry_deadline=20) as client:
            rids = [await client.submit(model="tiny", prompt=f"job {i}", max_tokens=48, temperature=0.0)
                    for i in range(6)]
            followers = {rid: asyncio.create_task(_follow(client, rid)) for rid in rids}
            status = await asyncio.to_thread(mlxq, cluster.url, "status", timeout=60)  # the CLI, on the same URL
            assert status.returncode == 0 and "tiny" in status.stdout, status.stderr
            # the first two are streaming, the rest queued, when the master dies
            await asyncio.sleep(1.0)
            old = cluster.master_port()
            cluster.master.kill()
            killed = time.monotonic()
            during: dict[str, str] = {}
            async with Client(cluster.url, retry_deadline=2) as hasty:
                while cluster.master_port() == old and time.monotonic() - killed < 30:
                    try:
                        during[await hasty.submit(model="tiny", prompt="during", max_tokens=4)] = "ok"
                    except QueueUnavailable as exc:
                        assert "unreachable within the 2s deadline" in str(exc)
                        during[f"refused{len(during)}"] = "refused"
            switched = time.monotonic() - killed
            assert cluster.master_port() != old, "no failover within 30s"
            full_speed()  # the jobs were mid-stream and queued when it died: the rest need not be slow
            accepted = [rid for rid, how in during.items() if how == "ok"]
            followers |= {rid: asyncio.create_task(_follow(client, rid)) for rid in accepted}
            outcomes = dict(zip(followers, await asyncio.gather(*followers.values()), strict=True))
            survived = {rid: await client._redis.exists(client.keys.job(rid), client.keys.log(rid))
                        for rid in outcomes}
        await running.close()
    finally:
        cluster.stop()
    ended = {rid: terminal(evs) for rid, evs in outcomes.items() if not isinstance(evs, str)}
    lost = [rid for rid, evs in outcomes.items() if isinstance(evs, str)]
    done = [rid for rid, end in ended.items() if end.type == "done"]
    rerun = [rid for rid, evs in outcomes.items() if not isinstance(evs, str) and any(e.type == "reset" for e in evs)]
    print(f"\nfailover after {switched:.1f}s: {len(rids)} jobs before (2 running, 4 queued), "
          f"{len(done)}/{len(outcomes)} done ({len(rerun)} re-run after a reset), {len(ended) - len(done)} error, "
          f"{len(lost)} lost with the old master; "
          f"submits during the switch: {len(accepted)} accepted, {len(during) - len(accepted)} refused "
          f"(QueueUnavailable); records kept: {sum(1 for v in survived.values() if v)}/{len(survived)}")
    for rid in rids:  # acknowledged before the master died: replicated (loopback replicates within a ms)
        assert not isinstance(outcomes[rid], str), f"job {rid} lost"
    assert all(not isinstance(e, MlxqError) for e in ended.values())


@pytest.fixture
def watched_master(tmp_path: Path) -> Any:
    """A Redis master and one sentinel watching it as MASTER: the sentinel URL and the sentinel."""
    master = RedisServer(tcp=True).start()
    node = _sentinel(tmp_path, master.port)
    try:
        yield f"redis+sentinel://127.0.0.1:{node.port}/{MASTER}", node
    finally:
        node.kill()
        master.stop()


async def test_a_client_given_a_master_name_no_sentinel_knows_fails_at_once(lone_sentinel: Any) -> None:
    node, _ = lone_sentinel
    # A deadline no test waits out: before, the name went unrecognised until the deadline (QueueUnavailable).
    async with Client(f"redis+sentinel://127.0.0.1:{node.port}/nosuchmaster", retry_deadline=3600) as client:
        with pytest.raises(ConfigError, match=f"^no sentinel of 127.0.0.1:{node.port} knows a master named "
                                              "'nosuchmaster' \\(MLXQ_REDIS_URL\\)$"):
            await client.submit(model="tiny", prompt="hi")


def _sentinel_clients(node: Node) -> int:
    with contextlib.closing(node.client()) as probe:
        return len(probe.client_list()) - 1  # less the probe itself


async def test_closing_a_client_closes_its_connections_to_the_sentinels(watched_master: Any) -> None:
    url, node = watched_master
    before = _sentinel_clients(node)
    client = Client(url)
    await client.submit(model="tiny", prompt="hi")  # asks the sentinel for the master, then enqueues there
    assert _sentinel_clients(node) > before
    await client.aclose()
    for _ in range(100):  # the sentinel sees the close a moment later
        if _sentinel_clients(node) == before:
            break
        await asyncio.sleep(0.05)
    assert _sentinel_clients(node) == before


def test_a_worker_process_is_awaited_through_a_sentinel_url(watched_master: Any, tiny_model: Path,
                                                            tmp_path: Path) -> None:
    # What `mlxq demo` and `mlxq bench` do with MLXQ_REDIS_URL: read the worker's health record synchronously.
    url, _ = watched_master
    proc = WorkerProcess({"MLXQ_MODEL": str(tiny_model), "MLXQ_MODEL_NAME": "tiny", "MLXQ_REDIS_URL": url},
                         tmp_path / "worker.log").start()
    try:
        status = proc.wait_ready()
        assert [m.name for m in status.models] == ["tiny"]
    finally:
        assert proc.stop() == 0
