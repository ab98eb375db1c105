"""A new user's configuration mistakes end in one line that says what to fix: a Redis URL without its scheme, a
password for a Redis that has none (at once, not after the retry deadline), an MLXQ_PREFIX other than the
workers'."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from mlxq.api.client import Client
from mlxq.api.connection import denied, is_denied, is_transient
from mlxq.api.errors import AccessDenied, ConfigError, NoWorker, UnexpectedPassword
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import ModelState, ModelStatus, WorkerStatus

ROOT = Path(__file__).resolve().parents[2]
NO_PASSWORD_SET = ("AUTH <password> called without any password configured for the default user. Are you sure "
                   "your configuration is correct?")


def mlxq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")} | env
    return subprocess.run([sys.executable, "-m", "mlxq.api.cli", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=120)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip()


@pytest.mark.parametrize("command", [["status"], ["submit", "--model", "m", "hi"], ["gateway", "--port", "0"]])
def test_a_redis_url_without_its_scheme_is_a_bad_setting(command: list[str]) -> None:
    done = mlxq(*command, env={"MLXQ_REDIS_URL": "localhost:6379"})
    assert done.returncode == 2
    assert one_line(done) == ("mlxq: MLXQ_REDIS_URL='localhost:6379': expected a URL redis://HOST:PORT, "
                              "rediss://HOST:PORT, unix:///PATH or redis+sentinel://HOST:PORT,HOST:PORT/MASTER "
                              "(e.g. redis://localhost:6379)")


def test_a_wrapped_refusal_of_a_password_is_a_refusal_and_a_configuration_error() -> None:
    # Over a unix socket redis-py raises ConnectionError(AuthenticationError(...)): not a transient error.
    wrapped = RedisConnectionError(AuthenticationError(NO_PASSWORD_SET))
    assert is_denied(wrapped) and not is_transient(wrapped)
    error = denied(wrapped, "unix:///tmp/r.sock")
    assert isinstance(error, UnexpectedPassword) and isinstance(error, ConfigError | AccessDenied)
    assert str(error).startswith("Redis at unix:///tmp/r.sock has no password set, but the URL gives one")


def _with_password(url: str) -> str:
    return url + ("&" if "?" in url else "?") + "password=s3cret"


async def test_a_password_for_a_redis_without_one_is_refused_at_once(redis_url: str) -> None:
    started = time.monotonic()
    async with Client(_with_password(redis_url), retry_deadline=60) as client:  # a retry would hang the test
        with pytest.raises(UnexpectedPassword) as caught:
            await client.submit(model="m", prompt="hi")
    assert time.monotonic() - started < 30
    assert "has no password set, but the URL gives one (MLXQ_REDIS_URL)" in str(caught.value)
    assert "s3cret" not in str(caught.value)
    done = mlxq("status", env={"MLXQ_REDIS_URL": _with_password(redis_url), "MLXQ_RETRY_DEADLINE": "60"})
    assert done.returncode == 2 and "has no password set" in one_line(done)


def _register(url: str, prefix: str, model: str) -> None:
    """A live worker's health record under ``prefix``, as a worker writes it."""
    keys, now = Keys(prefix), time.time()
    status = WorkerStatus(id="w1", host="h", pid=1, version="0", started_at=now, updated_at=now,
                          models=[ModelStatus(name=model, state=ModelState.SERVING, capacity=4)])
    r = redis.Redis.from_url(url)
    r.set(keys.worker(status.id), status.model_dump_json(), ex=60)
    r.zadd(keys.workers(), {status.id: int(now * 1000)})
    r.close()


async def test_no_live_worker_names_the_prefixes_whose_workers_serve(redis_url: str) -> None:
    _register(redis_url, "mlxq-demo-1234", "tiny")
    _register(redis_url, "another", "big")
    r = redis.Redis.from_url(redis_url)
    r.zadd("unrelated:workers", {"not-an-mlxq-worker": 1})  # another application's key of the same shape
    r.close()
    async with Client(redis_url, prefix="mlxq") as client:
        with pytest.raises(NoWorker) as caught:
            await client.submit(model="tiny", prompt="hi", require_worker=True)
    assert str(caught.value) == ("no live worker serves model 'tiny' (models served now: none); live workers under "
                                 "other prefixes: MLXQ_PREFIX=mlxq-demo-1234 ('tiny'), MLXQ_PREFIX=another ('big')")
    assert caught.value.elsewhere == {"mlxq-demo-1234": ["tiny"], "another": ["big"]}
    async with Client(redis_url, prefix="another") as client:  # its workers serve something: no look elsewhere
        with pytest.raises(NoWorker) as caught:
            await client.submit(model="tiny", prompt="hi", require_worker=True)
    assert str(caught.value) == "no live worker serves model 'tiny' (models served now: 'big')"


def test_mlxq_health_names_the_prefixes_whose_workers_serve(redis_url: str) -> None:
    _register(redis_url, "mlxq-demo-1234", "tiny")
    done = mlxq("health", "--model", "tiny", env={"MLXQ_REDIS_URL": redis_url})
    assert done.returncode == 1
    assert one_line(done) == ("mlxq: unhealthy: no live worker serves model 'tiny' (models served now: none); live "
                              "workers under other prefixes: MLXQ_PREFIX=mlxq-demo-1234 ('tiny')")
    assert mlxq("health", "--model", "tiny", env={"MLXQ_REDIS_URL": redis_url,
                                                  "MLXQ_PREFIX": "mlxq-demo-1234"}).returncode == 0
