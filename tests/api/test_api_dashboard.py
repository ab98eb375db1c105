"""The dashboard's routes over HTTP: a real gateway, Redis and worker process on the tiny model. Who may read
and act (reader and admin keys), what a reader sees of a job (sizes, not its prompt or output), that no GET
changes anything, the history and recent jobs the worker writes at each job's end, lost workers, dead-letter
retry, and ``mlxq dashboard``'s app alone. The page itself, in a browser: test_api_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from mlxq.api.cli import main
from mlxq.api.client import Client
from mlxq.api.errors import JobFailed
from mlxq.api.gateway.dashboard import create_dashboard_app
from mlxq.api.history import EDGES_MS, percentile
from mlxq.api.protocol.keys import Keys
from tests.api.gateway_support import PREFIX, Deployment, ServedGateway

pytestmark = pytest.mark.e2e

READER, ADMIN = "reader-key", "admin-key"
SECRET = "the <b>secret</b> prompt"


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, ServedGateway]]:
    d = Deployment(tiny_model, tmp_path_factory.mktemp("dash"))
    try:
        d.worker("tiny")
        with d.gateway(api_keys=frozenset({READER}), admin_keys=frozenset({ADMIN})) as gw:
            yield d, gw
    finally:
        d.close()


@pytest.fixture
async def client(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[Client]:
    async with Client(config=served[0].config.client) as c:
        yield c


@pytest.fixture
async def http(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served[1].url, timeout=30) as h:
        yield h


def key(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


async def fresh_overview(http: httpx.AsyncClient) -> dict:
    """The overview read after this call (readers within a second share one read)."""
    await asyncio.sleep(1.1)
    return (await http.get("/dashboard/api/overview", headers=key(READER))).json()  # type: ignore[no-any-return]


async def test_the_page_loads_without_a_key_and_holds_no_data(http: httpx.AsyncClient) -> None:
    page = await http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = await http.get(f"/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert (await http.get("/dashboard/static/..%2Fdashboard.py")).status_code == 404
    script = (await http.get("/dashboard/static/app.js")).text
    assert not re.search(r"(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write", script)  # text only


async def test_data_wants_a_key_and_actions_an_admin_key(http: httpx.AsyncClient) -> None:
    assert (await http.get("/dashboard/api/overview")).status_code == 401
    assert (await http.get("/dashboard/api/overview", headers=key("wrong"))).status_code == 401
    assert (await http.get("/dashboard/api/overview", headers=key(READER))).json()["admin"] is False
    assert (await http.get("/dashboard/api/overview", headers=key(ADMIN))).json()["admin"] is True
    cancel = await http.post("/dashboard/api/jobs/some-job/cancel", headers=key(READER))
    assert cancel.status_code == 403 and cancel.json()["error"]["code"] == "admin_key_required"
    assert (await http.post("/dashboard/api/dead/retry", json={"hex": "00"}, headers=key(READER))).status_code == 403
    assert (await http.post("/dashboard/api/jobs/some-job/cancel")).status_code == 401
    sessions = [(await http.get("/dashboard/api/session", headers=h)).json() for h in ({}, key(READER), key(ADMIN))]
    assert [(s["reader"], s["admin"]) for s in sessions] == [(False, False), (True, False), (True, True)]


async def test_no_get_changes_state(http: httpx.AsyncClient, client: Client) -> None:
    rid = await client.submit(model="ghost", prompt="waits", max_tokens=4, expires_in=0)
    for path in (f"/dashboard/api/jobs/{rid}/cancel", "/dashboard/api/dead/retry"):
        assert (await http.get(path, headers=key(ADMIN))).status_code == 405
    assert not await client.redis.exists(client.keys.cancel(rid))
    assert (await http.post(f"/dashboard/api/jobs/{rid}/cancel", headers=key(ADMIN))).json()["cancel_requested"]
    assert await client.redis.exists(client.keys.cancel(rid))
    await client.redis.delete(client.keys.queue("ghost"), client.keys.job(rid))


async def test_a_reader_sees_sizes_and_an_admin_the_prompt_and_output(http: httpx.AsyncClient,
                                                                     client: Client) -> None:
    queued = await client.submit(model="ghost", prompt=SECRET, max_tokens=4, expires_in=0)
    reader = (await http.get(f"/dashboard/api/jobs/{queued}", headers=key(READER))).json()
    assert reader["state"] == "queued" and reader["request"]["bytes"] > len(SECRET)
    assert reader["request"]["payload"]["max_tokens"] == 4 and "prompt" not in reader["request"]["payload"]
    admin = (await http.get(f"/dashboard/api/jobs/{queued}", headers=key(ADMIN))).json()
    assert admin["request"]["payload"]["prompt"] == SECRET  # JSON carries it as text; the page shows it as text
    await client.redis.delete(client.keys.queue("ghost"), client.keys.job(queued))

    result = await client.generate(model="tiny", prompt=SECRET, max_tokens=8)
    reader = (await http.get(f"/dashboard/api/jobs/{result.id}", headers=key(READER))).text
    assert "secret" not in reader and result.text not in reader
    tokens = [e for e in json.loads(reader)["events"] if e["type"] == "token"]
    assert sum(e["tokens"] for e in tokens) == result.usage.completion_tokens
    admin_events = (await http.get(f"/dashboard/api/jobs/{result.id}", headers=key(ADMIN))).json()["events"]
    assert "".join(e["text"] for e in admin_events if e["type"] == "token") == result.text
    missing = await http.get("/dashboard/api/jobs/no-such-job", headers=key(READER))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


async def test_a_jobs_end_lands_in_its_models_history_and_the_recent_list(http: httpx.AsyncClient,
                                                                          client: Client) -> None:
    result = await client.generate(model="tiny", prompt="count", max_tokens=6)
    data = await fresh_overview(http)
    summary = next(s for s in data["recent"] if s["id"] == result.id)
    assert summary["model"] == "tiny" and summary["type"] == "done" and summary["reason"] == result.finish_reason.value
    assert summary["tenant"] == "default"
    assert summary["completion_tokens"] == result.usage.completion_tokens
    assert summary["worker"] == data["workers"][0]["id"]
    (tiny,) = [m for m in data["models"] if m["name"] == "tiny"]
    assert len(tiny["history"]) == 90  # 15 minutes of 10-second buckets
    assert sum(p["tokens_per_s"] * 10 for p in tiny["history"]) >= result.usage.completion_tokens
    assert any(p["ttft_p50"] is not None for p in tiny["history"])
    assert tiny["served"]["workers"] == 1
    assert await client.redis.ttl(Keys(PREFIX).recent()) > 0  # bounded in time and length (api.history)
    (served,) = data["workers"][0]["models"]  # what the workers table shows of its model
    assert "cpu" in served["device"] and served["kv_headroom_bytes"] > 0
    assert served["prefix_hits"] + served["prefix_misses"] >= 0


async def test_a_tenants_job_lands_in_its_models_history(http: httpx.AsyncClient, client: Client) -> None:
    # A tenant's queue is named <prefix>:tqueue:<tenant>:<model>: its end still counts for its model.
    result = await client.generate(model="tiny", prompt="count", max_tokens=3, tenant="acme")
    data = await fresh_overview(http)
    summary = next(s for s in data["recent"] if s["id"] == result.id)
    assert (summary["model"], summary["tenant"]) == ("tiny", "acme")  # the recent jobs' tenant column
    (tiny,) = [m for m in data["models"] if m["name"] == "tiny"]
    assert sum(p["tokens_per_s"] * 10 for p in tiny["history"]) >= result.usage.completion_tokens
    # The tenants panel: its use (the minute's tokens) and a policy entry with no jobs.
    from mlxq.api import tenants

    await tenants.store(client.redis, client.keys, "acme", weight=1)
    await tenants.store(client.redis, client.keys, "globex", weight=3, max_running=2)
    listed = {t["name"]: t for t in (await fresh_overview(http))["tenants"]}  # those with entries, jobs queued or
    # running, or tokens over the last minute (as `mlxq tenants`): the default tenant's earlier jobs count too
    assert listed["acme"]["tokens_per_minute"] >= result.usage.completion_tokens
    assert sum(t["share"] for t in listed.values()) == pytest.approx(1, abs=0.01) and listed["acme"]["share"] > 0
    assert listed["globex"]["named"] and listed["globex"]["policy"]["weight"] == 3
    assert listed["globex"]["policy"]["max_running"] == 2


async def test_a_job_that_expired_queued_is_counted_as_an_error(http: httpx.AsyncClient, client: Client) -> None:
    rid = await client.submit(model="ghost", prompt="nobody serves it", max_tokens=2, expires_in=0.2)
    with pytest.raises(JobFailed):
        await client.result(rid, timeout=60)  # the worker's reaper ends it (EMIT's x write)
    data = await fresh_overview(http)
    summary = next(s for s in data["recent"] if s["id"] == rid)
    assert (summary["model"], summary["type"], summary["reason"], summary["worker"]) == ("ghost", "error", "expired",
                                                                                        "")
    (ghost,) = [m for m in data["models"] if m["name"] == "ghost"]
    assert sum(p["errors"] for p in ghost["history"]) == 1


async def test_a_worker_that_stopped_heartbeating_is_listed_as_lost(http: httpx.AsyncClient, client: Client) -> None:
    await client.redis.zadd(client.keys.workers(), {"gone-worker": int(time.time() * 1000) - 30_000})
    try:
        data = await fresh_overview(http)
        assert [w["id"] for w in data["lost"]] == ["gone-worker"]
        assert "gone-worker" not in [w["id"] for w in data["workers"]]
    finally:
        await client.redis.zrem(client.keys.workers(), "gone-worker")


async def test_queued_jobs_are_counted_by_priority(http: httpx.AsyncClient, client: Client) -> None:
    ids = [await client.submit(model="ghost", prompt="p", max_tokens=1, priority=p, expires_in=0) for p in (5, 5, 0)]
    try:
        data = await fresh_overview(http)
        (ghost,) = [m for m in data["models"] if m["name"] == "ghost"]
        assert ghost["queued"] == 3 and ghost["by_priority"] == {"5": 2, "0": 1} and ghost["served"] is None
    finally:
        await client.redis.delete(client.keys.queue("ghost"), *(client.keys.job(i) for i in ids))


async def test_an_admin_retries_a_dead_letter_through_the_enqueue_path(http: httpx.AsyncClient,
                                                                      client: Client) -> None:
    rid = await client.submit(model="ghost", prompt="again", max_tokens=3, expires_in=0)
    queue = client.keys.queue("ghost")
    await client.redis.zrem(queue, rid)  # as a worker's REJECT moves an entry aside
    letter = {"queue": queue, "entry": rid, "hex": rid.encode().hex(), "reason": "test", "at_ms": 0, "worker": "w"}
    await client.redis.lpush(client.keys.dead_letters(), json.dumps(letter))
    gone = {**letter, "entry": "nothing-left", "hex": b"nothing-left".hex()}
    await client.redis.lpush(client.keys.dead_letters(), json.dumps(gone))
    try:
        refused = await http.post("/dashboard/api/dead/retry", json={"hex": gone["hex"]}, headers=key(ADMIN))
        assert refused.status_code == 400 and "record is gone" in refused.json()["error"]["message"]
        retried = await http.post("/dashboard/api/dead/retry", json={"hex": letter["hex"]}, headers=key(ADMIN))
        new_id = retried.json()["id"]
        assert retried.status_code == 200 and new_id != rid
        assert await client.redis.zscore(queue, new_id) is not None
        left = [json.loads(x)["entry"] for x in await client.redis.lrange(client.keys.dead_letters(), 0, -1)]
        assert left == ["nothing-left"]
    finally:
        await client.redis.delete(client.keys.dead_letters(), queue)


async def test_mlxq_dashboard_serves_the_same_app_alone(served: tuple[Deployment, ServedGateway]) -> None:
    d = served[0]
    import dataclasses

    alone = ServedGateway(create_dashboard_app(dataclasses.replace(d.config, api_keys=frozenset({READER})))).start()
    try:
        async with httpx.AsyncClient(base_url=alone.url, timeout=30) as h:
            assert (await h.get("/dashboard")).status_code == 200
            home = await h.get("/", follow_redirects=True)  # the address `mlxq dashboard` prints
            assert home.status_code == 200 and home.url.path == "/dashboard" and "<html" in home.text.lower()
            data = (await h.get("/dashboard/api/overview", headers=key(READER))).json()
            assert [m["name"] for m in data["models"] if m["served"]] == ["tiny"] and data["admin"] is False
            assert (await h.post("/v1/completions", json={})).status_code == 404  # the dashboard, no API
    finally:
        alone.stop()


def test_percentiles_come_from_the_histograms_bins() -> None:
    counts = [0] * len(EDGES_MS)
    assert percentile(counts, 0.5) is None
    counts[2], counts[5] = 98, 2  # 98 jobs in (10, 20] ms, 2 in (100, 200] ms
    assert percentile(counts, 0.5) == pytest.approx(10 + 10 * 50 / 98)
    assert percentile(counts, 0.99) == pytest.approx(100 + 100 * 1 / 2)
    assert percentile(counts, 1.0) == 200.0


def test_mlxq_dashboard_is_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dashboard", "--help"])
    assert exited.value.code == 0 and "MLXQ_ADMIN_KEYS" in capsys.readouterr().out
