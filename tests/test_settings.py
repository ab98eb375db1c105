"""Settings are declared once: the operators' table is made from the declarations, every variable the product
names is declared, and the declarations parse as the docs say."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mlxq.api.cli import main
from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.errors import ConfigError, MlxqError
from mlxq.api.gateway.config import GatewayConfig
from mlxq.api.settings import declared, names, undeclared
from mlxq.worker.config import SETTING_GROUPS, WorkerConfig, reference

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- settings:begin -->\n", "<!-- settings:end -->"
INTERNAL = {"MLXQ_BENCH_REEXEC"}  # set by `mlxq bench` in the process it re-executes, never by an operator


def test_the_table_in_deploy_readme_is_the_one_the_declarations_make() -> None:
    text = (ROOT / "deploy" / "README.md").read_text()
    assert "\n## Settings\n" in text
    table = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert table == reference(), "stale: python3 -m mlxq.worker.config prints the table to put between the markers"


def test_every_variable_the_product_or_its_docs_name_is_declared() -> None:
    names = {s.name for _, cls in SETTING_GROUPS for _, s in declared(cls)}
    sources = [p for folder in ("api", "engine", "worker") for p in (ROOT / folder).rglob("*.py")]
    docs = [ROOT / "README.md", *(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]  # units, plists too
    named: dict[str, str] = {}
    for path in [*sources, *docs]:
        for name in re.findall(r"\bMLXQ_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            named.setdefault(name, str(path.relative_to(ROOT)))
    assert len(named) > 40
    assert {n: where for n, where in named.items() if n not in names | INTERNAL} == {}


def test_a_variable_both_sides_read_is_one_declaration() -> None:
    client = {s.name: (f.default, s) for f, s in declared(ClientConfig)}
    worker = {s.name: (f.default, s) for f, s in declared(WorkerConfig)}
    both = client.keys() & worker.keys()
    assert {"MLXQ_REDIS_URL", "MLXQ_PREFIX", "MLXQ_MAX_PAYLOAD_BYTES", "MLXQ_MAX_IMAGES"} <= both
    assert all(client[n] == worker[n] for n in both)
    names = [s.name for _, cls in SETTING_GROUPS for _, s in declared(cls) if cls is not WorkerConfig]
    assert len(names) == len(set(names))  # within the producers' side, each once


def test_values_parse_as_declared_and_unset_or_blank_ones_keep_their_defaults() -> None:
    assert WorkerConfig.from_env({}).capacity == 32
    cfg = WorkerConfig.from_env({"MLXQ_BATCH_CAPACITY": " 8 ", "MLXQ_STREAM_RATE": "", "MLXQ_IMAGE_URLS": "yes",
                                 "MLXQ_KV_HEADROOM_GB": "1.5", "MLXQ_MODEL_NAME": "", "MLXQ_LOG_LEVEL": "debug",
                                 "MLXQ_SPECULATE": "off"})
    assert (cfg.capacity, cfg.stream_rate, cfg.image_urls, cfg.kv_headroom_gb, cfg.model_name, cfg.log_level,
            cfg.speculate) == (8, 1600.0, True, 1.5, "", "DEBUG", "")
    assert GatewayConfig.from_env({"MLXQ_MAX_PAYLOAD_BYTES": "10", "MLXQ_MAX_IMAGES": "0"}).max_body_bytes == 10


@pytest.mark.parametrize(("env", "message"), [
    ({"MLXQ_RETRY_DEADLINE": "soon"}, "MLXQ_RETRY_DEADLINE='soon': expected a number"),
    ({"MLXQ_MAX_QUEUED": "-1"}, "MLXQ_MAX_QUEUED='-1': expected an integer >= 0"),
    ({"MLXQ_MAX_IMAGES": "2.5"}, "MLXQ_MAX_IMAGES='2.5': expected an integer"),
    ({"MLXQ_GATEWAY_PORT": "http"}, "MLXQ_GATEWAY_PORT='http': expected an integer"),
    ({"MLXQ_GATEWAY_MAX_TOKENS": "0"}, "MLXQ_GATEWAY_MAX_TOKENS='0': expected an integer >= 1"),
    ({"MLXQ_REDIS_URL": "localhost:6379"}, "MLXQ_REDIS_URL='localhost:6379': expected a URL redis://HOST:PORT, "
                                           "rediss://HOST:PORT, unix:///PATH or redis+sentinel://HOST:PORT,"
                                           "HOST:PORT/MASTER (e.g. redis://localhost:6379)"),
])
def test_a_bad_value_is_one_line_naming_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        GatewayConfig.from_env(env)
    assert str(caught.value) == message


def test_a_redis_url_with_credentials_is_not_echoed_when_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        ClientConfig.from_env({"MLXQ_REDIS_URL": "user:secret@host:6379"})
    assert "secret" not in str(caught.value)


def test_a_client_given_a_url_without_a_scheme_raises_an_mlxq_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="redis_url='localhost:6379': expected a URL"):
        Client("localhost:6379")
    monkeypatch.setenv("MLXQ_REDIS_URL", "localhost:6379")
    with pytest.raises(MlxqError, match="MLXQ_REDIS_URL='localhost:6379'"):  # as example.py catches it
        Client()


def test_a_variable_no_side_declares_is_one_warning_naming_the_closest_declared_name() -> None:
    known = names(cls for _, cls in SETTING_GROUPS)
    env = {"MLXQ_BATCH_CAPACITI": "8", "MLXQ_BATCH_CAPACITY": "8", "MLXQ_ZZZZZZZZ": "1", "MLXQ_BENCH_REEXEC": "1",
           "HOME": "/root"}
    assert undeclared(env, known) == [
        "MLXQ_BATCH_CAPACITI is not an mlxq setting: ignored; did you mean MLXQ_BATCH_CAPACITY?",
        "MLXQ_ZZZZZZZZ is not an mlxq setting: ignored"]


def test_the_cli_warns_of_a_misspelt_variable_and_not_of_the_workers_own(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for name in [n for n in os.environ if n.startswith("MLXQ_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLXQ_REDIS_URL", "localhost:6379")  # refused before anything connects: exit 2
    monkeypatch.setenv("MLXQ_RETRY_DEADLNE", "3")
    monkeypatch.setenv("MLXQ_BATCH_CAPACITY", "8")  # a worker's, in an environment both share
    assert main(["status"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == ("mlxq: warning: MLXQ_RETRY_DEADLNE is not an mlxq setting: ignored; did you mean "
                       "MLXQ_RETRY_DEADLINE?")
    assert error.startswith("mlxq: MLXQ_REDIS_URL='localhost:6379'")


def test_the_model_kind_is_auto_chat_or_embedding() -> None:
    assert WorkerConfig.from_env({}).model_kind == "auto"
    assert WorkerConfig.from_env({"MLXQ_MODEL_KIND": " Embedding "}).model_kind == "embedding"
    assert WorkerConfig.from_env({"MLXQ_MODEL_KIND": ""}).model_kind == "auto"
    with pytest.raises(ConfigError, match="MLXQ_MODEL_KIND='reranker': expected one of auto, chat, embedding"):
        WorkerConfig.from_env({"MLXQ_MODEL_KIND": "reranker"})
