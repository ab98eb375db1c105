"""deploy/: the shared Redis configuration runs as written, and its ACL user can do everything mlxq does (a real
worker, jobs, cancels, status) and nothing outside the prefix."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client.parser import text_string_to_metric_families

from mlxq.api.client import Client
from mlxq.api.errors import AccessDenied
from mlxq.api.fleet import overview
from mlxq.api.status import collect
from mlxq.worker.tools.redis_server import find_redis_server
from tests.support import config_with, free_port, start_worker

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cret-for-the-test"


@pytest.fixture(scope="module")
def deployed_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """deploy/redis/redis.conf with its users.acl, on a loopback port of the test's own."""
    tmp = tmp_path_factory.mktemp("deployed-redis")
    acl = (ROOT / "deploy/redis/users.acl").read_text().replace("CHANGE-ME-TO-A-LONG-RANDOM-SECRET", SECRET)
    (tmp / "users.acl").write_text(acl.replace("CHANGE-ME-TOO", "admin-" + SECRET))
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), str(ROOT / "deploy/redis/redis.conf"), "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(tmp), "--aclfile", str(tmp / "users.acl"),
                             "--daemonize", "no", "--logfile", str(tmp / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = redis.Redis(port=port, username="admin", password="admin-" + SECRET)
    try:
        for _ in range(500):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (tmp / "redis.log").read_text()
                time.sleep(0.02)
        yield port
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_the_shared_redis_keeps_its_data_and_never_evicts(deployed_redis: int) -> None:
    admin = redis.Redis(port=deployed_redis, username="admin", password="admin-" + SECRET, decode_responses=True)
    try:
        config = {k: v for key in ("appendonly", "appendfsync", "maxmemory-policy")
                  for k, v in admin.config_get(key).items()}
        assert config == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    finally:
        admin.close()


async def test_the_mlxq_acl_user_runs_everything_mlxq_does(deployed_redis: int, worker_config: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    url = f"redis://mlxq:{SECRET}@127.0.0.1:{deployed_redis}"
    running = await start_worker(config_with(worker_config, redis_url=url))
    try:
        async with Client(url) as client:
            result = await client.generate(model="tiny", prompt="Hello", max_tokens=5, timeout=60)
            assert result.usage.completion_tokens == 5
            rid = await client.submit(model="tiny", prompt="cancel me", max_tokens=400)
            cancelled = False
            async for ev in client.events(rid, timeout=60):  # tokens already sent may follow the cancel
                if ev.type == "token" and not cancelled:
                    cancelled = await client.cancel(rid)
                    assert cancelled
            assert (await client.result(rid, timeout=60)).finish_reason.value == "cancelled"
            report = await collect(client)
            assert report.models["tiny"].workers == 1
            board = await overview(client)  # the dashboard's reads, and the history the worker wrote
            assert {j["id"] for j in board["recent"]} == {result.id, rid}
        outside = aredis.Redis.from_url(url)
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await outside.set("elsewhere", "1")  # keys outside the prefix
            with pytest.raises(redis.exceptions.NoPermissionError):
                await outside.flushall()
        finally:
            await outside.aclose()
        async with Client(f"redis://127.0.0.1:{deployed_redis}", retry_deadline=60) as anonymous:
            with pytest.raises(AccessDenied):  # the default user is off
                await asyncio.wait_for(anonymous.submit(model="tiny", prompt="hi"), 30)
    finally:
        await running.close()
    # Nothing the worker does was refused (a NOPERM on any of its commands is logged, not raised).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("worker")]


async def test_every_metric_the_grafana_dashboard_queries_is_one_a_worker_serves(worker_config: Any,
                                                                                client: Client) -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/mlxq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"]["query"])
    queried = {name for e in exprs for name in re.findall(r"mlxq:[a-z0-9_:]+", e)}
    port = free_port()
    running = await start_worker(config_with(worker_config, metrics_port=port, metrics_addr="127.0.0.1"))
    try:
        await client.generate(model="tiny", prompt="Hello", max_tokens=5, timeout=60)
        url = f"http://127.0.0.1:{port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    finally:
        await running.close()
    served = set()
    for family in text_string_to_metric_families(text):
        kind = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        served |= {family.name + suffix for suffix in kind} | {s.name for s in family.samples}
    assert len(queried) > 20 and queried - served == set()
