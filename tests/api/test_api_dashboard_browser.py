"""The dashboard in a real browser: Debian's chromium, headless, driven by selenium through chromium-driver,
against a real gateway, Redis and worker (in this process, its engine's steps slowed so a job runs long enough
to be cancelled). The page loads with no console errors, shows a job within 2 s of its submit, cancels it, shows
a prompt holding markup as text, is read-only without an admin key; and a PNG of each main view is written to
the test's folder (its path printed) for a person to look at. Skipped where chromium is not installed
(``.ci/run`` installs it)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.gateway import GatewayConfig, create_app
from mlxq.api.protocol.keys import Keys
from tests.api.gateway_support import ServedGateway
from tests.support import RunningWorker, slow_steps, start_worker

pytestmark = pytest.mark.slow

READER, ADMIN = "reader-key", "admin-key"
MARKUP = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
SHOWN_S = 2.0  # the promise: a job shows within 2 s of its submit


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return None
    return browser, driver


selenium = pytest.importorskip("selenium", reason="needs selenium (the test extra)")
if _chromium() is None:
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


class LoopThread:
    """An event loop in a thread of its own: the worker runs there while selenium blocks this one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="worker-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, redis_server: Any) -> Iterator[tuple[ServedGateway, LoopThread, ClientConfig]]:
    """A worker serving ``tiny`` (each step slowed to 0.1 s) and a gateway with reader and admin keys."""
    import redis as sync_redis

    from mlxq.worker.config import WorkerConfig

    sync_redis.Redis.from_url(redis_server.url).flushall()
    prefix = "dash"
    config = WorkerConfig(model=str(tiny_model), model_name="tiny", redis_url=redis_server.url, prefix=prefix,
                          capacity=4, poll_delay_s=0.25, cancel_poll_s=0.1, drain_timeout_s=2.0)
    loop = LoopThread()
    running: RunningWorker = loop.run(start_worker(config))
    slow_steps(running, 0.1)
    client = ClientConfig(redis_url=redis_server.url, prefix=prefix)
    gw = ServedGateway(create_app(GatewayConfig(client=client, api_keys=frozenset({READER}),
                                                admin_keys=frozenset({ADMIN})))).start()
    try:
        yield gw, loop, client
    finally:
        gw.stop()
        loop.run(running.close(drain_s=2.0))
        loop.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    found = _chromium()
    assert found is not None
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def sign_in(driver: webdriver.Chrome, url: str, key: str, view: str = "") -> None:
    driver.get("about:blank")  # a new page: a URL that differs only in its fragment would not load again
    driver.get(f"{url}/dashboard#/{view}")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login-button").click()
    role = "admin" if key == ADMIN else "read-only"
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "role").text == role)


def submit(fleet: tuple[ServedGateway, LoopThread, ClientConfig], **fields: Any) -> str:
    async def go() -> str:
        async with Client(config=fleet[2]) as c:
            return await c.submit(**fields)
    return str(fleet[1].run(go()))


def result_of(fleet: tuple[ServedGateway, LoopThread, ClientConfig], rid: str) -> Any:
    async def go() -> Any:
        async with Client(config=fleet[2]) as c:
            return await c.result(rid, timeout=60)
    return fleet[1].run(go())


def open_job(driver: webdriver.Chrome, url: str, rid: str, ready: str = "State", part: str = "job-facts") -> None:
    driver.get(f"{url}/dashboard#/job/{rid}")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "job-id").text == rid and ready in
                                    d.find_element(By.ID, part).text)


def errors_in_console(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_page_loads_without_console_errors_and_shows_the_fleet(fleet: Any, browser: webdriver.Chrome) -> None:
    sign_in(browser, fleet[0].url, READER)
    WebDriverWait(browser, 30).until(lambda d: "tiny" in d.find_element(By.ID, "models").text)
    workers = browser.find_element(By.ID, "workers").text
    assert "serving" in workers and "(cpu," in workers and "B / " in workers  # its device, KV used / headroom
    assert errors_in_console(browser) == []


def test_a_job_shows_within_2s_and_a_cancel_from_the_page_ends_it(fleet: Any, browser: webdriver.Chrome) -> None:
    sign_in(browser, fleet[0].url, ADMIN, "jobs")
    rid = submit(fleet, model="tiny", prompt="a long one", max_tokens=400)
    WebDriverWait(browser, SHOWN_S, poll_frequency=0.05).until(
        lambda d: rid in d.find_element(By.ID, "running").text)
    browser.find_element(By.CSS_SELECTOR, f'#running button[data-job="{rid}"]').click()
    done = result_of(fleet, rid)
    assert done.finish_reason.value == "cancelled" and done.usage.completion_tokens < 400
    WebDriverWait(browser, 30).until(lambda d: rid in d.find_element(By.ID, "recent").text)
    assert "cancelled" in browser.find_element(By.ID, "recent").text
    assert errors_in_console(browser) == []


def test_a_prompt_holding_markup_shows_as_text(fleet: Any, browser: webdriver.Chrome) -> None:
    rid = submit(fleet, model="tiny", prompt=MARKUP, max_tokens=3)
    result_of(fleet, rid)
    sign_in(browser, fleet[0].url, ADMIN)
    open_job(browser, fleet[0].url, rid, "done")
    # An ended job's record is gone: the markup to show is in a queued one's request.
    queued = submit(fleet, model="ghost", prompt=MARKUP, max_tokens=3, expires_in=0)
    open_job(browser, fleet[0].url, queued, "<script>", "job-request")
    assert MARKUP.replace('"', '\\"') in browser.find_element(By.ID, "job-request").text
    assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
    assert browser.execute_script("return window.pwned === undefined")
    assert errors_in_console(browser) == []


def test_without_an_admin_key_the_page_is_read_only(fleet: Any, browser: webdriver.Chrome) -> None:
    rid = submit(fleet, model="ghost", prompt="private words", max_tokens=3, expires_in=0)
    sign_in(browser, fleet[0].url, READER, "jobs")
    browser.find_element(By.ID, "search-id").send_keys(rid)  # search by id
    browser.find_element(By.CSS_SELECTOR, "#search button").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "job-id").text == rid and "bytes" in
                                     d.find_element(By.ID, "job-request").text)
    assert "private words" not in browser.page_source
    assert not browser.find_element(By.ID, "job-cancel").is_displayed()
    assert browser.find_element(By.ID, "role").text == "read-only"
    browser.get(f"{fleet[0].url}/dashboard#/jobs")
    WebDriverWait(browser, 30).until(lambda d: not d.find_element(By.ID, "view-jobs").get_attribute("hidden"))
    assert browser.find_elements(By.CSS_SELECTOR, "#running button") == []


def test_a_wrong_key_leaves_none_of_the_earlier_keys_data_on_screen(fleet: Any, browser: webdriver.Chrome) -> None:
    sign_in(browser, fleet[0].url, READER)
    WebDriverWait(browser, 30).until(lambda d: "tiny" in d.find_element(By.ID, "models").text)
    browser.find_element(By.ID, "key").send_keys("wrong-key")
    browser.find_element(By.ID, "login-button").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "role").text == "not signed in")
    for table in ("models", "tenants", "workers", "running", "recent", "dead"):
        assert browser.execute_script(f"return document.getElementById('{table}').tBodies[0].rows.length") == 0
    assert "tiny" not in browser.find_element(By.TAG_NAME, "main").get_attribute("textContent")


def test_a_gateway_without_keys_offers_no_sign_in_or_out(fleet: Any, browser: webdriver.Chrome) -> None:
    open_gw = ServedGateway(create_app(GatewayConfig(client=fleet[2]))).start()
    try:
        browser.get("about:blank")
        browser.get(f"{open_gw.url}/dashboard")
        WebDriverWait(browser, 30).until(lambda d: "tiny" in d.find_element(By.ID, "models").text)
        assert not any(browser.find_element(By.ID, i).is_displayed() for i in ("key", "login-button", "logout"))
    finally:
        open_gw.stop()
    sign_in(browser, fleet[0].url, READER)  # where keys are needed, the form is there
    assert browser.find_element(By.ID, "logout").is_displayed()


def test_recent_jobs_name_their_tenant(fleet: Any, browser: webdriver.Chrome) -> None:
    async def go() -> str:
        async with Client(config=fleet[2], tenant="acme") as c:
            return str((await c.generate(model="tiny", prompt="hi", max_tokens=2, timeout=60)).id)
    rid = fleet[1].run(go())
    sign_in(browser, fleet[0].url, READER, "jobs")
    WebDriverWait(browser, 30).until(lambda d: rid in d.find_element(By.ID, "recent").text)
    row = browser.find_element(By.XPATH, f'//table[@id="recent"]//tr[td/a[text()="{rid}"]]')
    assert [td.text for td in row.find_elements(By.TAG_NAME, "td")][1:3] == ["tiny", "acme"]


def test_the_latency_charts_spread_the_minutes_with_jobs_over_their_width(fleet: Any,
                                                                         browser: webdriver.Chrome) -> None:
    import redis as sync_redis

    from mlxq.api.history import BUCKET_S

    r = sync_redis.Redis.from_url(fleet[2].redis_url)  # jobs two minutes and one minute ago, then one now
    now = int(time.time()) // BUCKET_S
    for ago in (12, 6):
        r.hset(Keys(fleet[2].prefix).history("tiny", now - ago), mapping={"n": 1, "tok": 5, "t3": 1, "w3": 1})
    r.close()
    result_of(fleet, submit(fleet, model="tiny", prompt="now", max_tokens=2))
    sign_in(browser, fleet[0].url, READER)
    width = ("const tiny = Array.from(document.querySelectorAll('#models tbody tr'))"
             ".find((tr) => tr.cells[0].textContent === 'tiny');"
             "const line = tiny && tiny.cells[{}].querySelector('svg polyline');"
             "return line ? line.getBBox().width : 0")
    for column in (9, 10):  # TTFT, queue wait: their p50 lines span the two minutes, not a sixth of the chart
        WebDriverWait(browser, 30).until(lambda d, c=column: d.execute_script(width.format(c)) > 80)


def test_webhook_deliveries_given_up_and_endpoints_a_410_disabled_show_on_the_overview(
        fleet: Any, browser: webdriver.Chrome) -> None:
    import redis.asyncio as aredis

    from mlxq.api.protocol.notify import disable_endpoint

    keys = Keys(fleet[2].prefix)
    failure = {"event": "evt_1700000000000_0", "type": "response.failed", "id": "resp_hooked", "tenant": "default",
               "url": "https://hooks.example/down", "error": "HTTP 503", "attempts": 12,
               "at_ms": int(time.time() * 1000)}

    async def record() -> None:  # as a gateway records them (api/gateway/webhooks.py)
        r = aredis.Redis.from_url(fleet[2].redis_url)
        await r.lpush(keys.webhook_failures(), json.dumps(failure))
        await r.hincrby(keys.webhook_counts(), "failed", 1)
        await disable_endpoint(r, keys, "https://hooks.example/gone", "evt_1700000000000_1")
        await r.aclose()
    fleet[1].run(record())
    sign_in(browser, fleet[0].url, READER)
    WebDriverWait(browser, 30).until(lambda d: "resp_hooked" in d.find_element(By.ID, "webhook-failures").text)
    (cells,) = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in browser.find_elements(By.CSS_SELECTOR, "#webhook-failures tbody tr")
                if "resp_hooked" in tr.text]
    assert cells[:6] == ["https://hooks.example/down", "response.failed", "resp_hooked", "evt_1700000000000_0",
                         "12", "HTTP 503"]
    assert "https://hooks.example/gone" in browser.find_element(By.ID, "webhook-disabled").text
    assert "1 given up" in browser.find_element(By.ID, "webhooks-summary").text
    assert errors_in_console(browser) == []


def test_a_screenshot_of_each_main_view(fleet: Any, browser: webdriver.Chrome, tmp_path: Path) -> None:
    import redis as sync_redis

    rid = submit(fleet, model="tiny", prompt="Tell me about <b>queues</b>.", max_tokens=12)
    result_of(fleet, rid)
    r = sync_redis.Redis.from_url(fleet[2].redis_url)  # a lost worker and a dead letter, to show them too
    keys = Keys(fleet[2].prefix)
    r.zadd(keys.workers(), {"mac-studio-4-71233-9f1c2a": int(time.time() * 1000) - 95_000})
    r.lpush(keys.dead_letters(), json.dumps({"queue": keys.queue("tiny"), "entry": "\\xff<not a job>", "hex": "ff",
                                             "reason": "the queue entry is not a job id",
                                             "at_ms": int(time.time() * 1000), "worker": "mac-studio-1-8812-a1b2c3"}))
    r.hset(keys.tenant("acme"), mapping={"weight": "3", "max_running": "2", "max_queued": "0",
                                         "tokens_per_minute": "0"})  # a tenant's policy, for the tenants panel
    r.sadd(keys.tenants(), "acme")
    r.close()
    submit(fleet, model="tiny", prompt="still going", max_tokens=200)
    sign_in(browser, fleet[0].url, ADMIN)
    shots = {"overview": ("", "tenants", "acme"), "jobs": ("jobs", "recent", rid),
             "dead": ("dead", "dead", "not a job id"), "job": (f"job/{rid}", "job-facts", "done")}
    for name, (view, element, text) in shots.items():
        browser.get(f"{fleet[0].url}/dashboard#/{view}")
        section = browser.find_element(By.ID, f"view-{name}")
        WebDriverWait(browser, 30).until(lambda d, e=element, t=text, s=section: t in d.find_element(By.ID, e).text
                                         and s.is_displayed())
        path = tmp_path / f"dashboard-{name}.png"
        assert browser.save_screenshot(str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"dashboard screenshots: {sorted(p.name for p in tmp_path.iterdir())} in {tmp_path}")
