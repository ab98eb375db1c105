"""A Sentinel set named by MLXQ_REDIS_URL: what the URL may hold, and one line for what it must not."""

from __future__ import annotations

import pytest

from mlxq.api.config import ClientConfig
from mlxq.api.connection import SentinelUrl, redact, sentinel_url
from mlxq.api.errors import ConfigError
from tests.api.test_api_config_errors import mlxq, one_line

pytestmark = pytest.mark.unit


def test_a_sentinel_url_names_the_sentinels_the_master_and_how_to_talk_to_each() -> None:
    url = "rediss+sentinel://me:p%40ss@h1:26380,[::1]:1,h3/cache/2?sentinel_password=s3"
    assert sentinel_url(url) == SentinelUrl(sentinels=(("h1", 26380), ("::1", 1), ("h3", 26379)), master="cache",
                                            db=2, username="me", password="p@ss", ssl=True,
                                            sentinel_password="s3")
    assert sentinel_url("redis://h:6379") is None
    assert ClientConfig.from_env({"MLXQ_REDIS_URL": url}).redis_url == url


def test_neither_password_is_ever_shown() -> None:
    assert redact("redis+sentinel://me:secret@h1,h2/m?sentinel_password=other") == "redis+sentinel://me:***@h1,h2/m"


@pytest.mark.parametrize("url,why", [
    ("redis+sentinel://h1:port/m", "bad port in 'h1:port'"),
    ("redis+sentinel:///m", "no sentinel address"),
    ("redis+sentinel://h1,h2", "the path must be the master's name, then optionally a database number"),
    ("redis+sentinel://h1/m/x", "database 'x' is not a number"),
    ("redis+sentinel://h1/m?sentinel_pasword=x", "unknown option 'sentinel_pasword'"),
])
def test_a_malformed_sentinel_url_is_one_line_naming_the_variable(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ClientConfig.from_env({"MLXQ_REDIS_URL": url})
    assert str(caught.value).startswith(f"MLXQ_REDIS_URL={url!r}: {why}")


def test_a_malformed_sentinel_url_with_a_password_never_echoes_it() -> None:
    with pytest.raises(ConfigError) as caught:
        ClientConfig.from_env({"MLXQ_REDIS_URL": "redis+sentinel://:hunter2@h1:x/m"})
    assert "hunter2" not in str(caught.value) and "<a URL with credentials>" in str(caught.value)


def test_the_cli_refuses_a_malformed_sentinel_url_in_one_line_with_exit_2() -> None:
    done = mlxq("status", env={"MLXQ_REDIS_URL": "redis+sentinel://h1:26379"})
    assert done.returncode == 2
    assert one_line(done).startswith("mlxq: MLXQ_REDIS_URL='redis+sentinel://h1:26379': the path must be")
