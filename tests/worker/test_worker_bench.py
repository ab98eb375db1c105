"""``mlxq bench``, the user's benchmark: the quick run end to end (embedded Redis, the tiny model, a worker and a
gateway subprocess), the command as a user runs it on a model of their own, and its pieces.

No wall-clock thresholds: the numbers depend on the machine; only their presence and consistency are held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.cli import _parser
from mlxq.worker.tools import bench, blas
from mlxq.worker.tools.bench import preload
from mlxq.worker.tools.bench.http import SseClient
from mlxq.worker.tools.bench.paths import stream
from tests.support import quick_run_fixtures

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def _args(out: Path, **over: Any) -> argparse.Namespace:
    ns = argparse.Namespace(command="bench", out=str(out), quick=True, model=None, concurrency=None, max_tokens=None)
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


# One quick bench (the generated tiny model, N in {1, 4}) shared by the tests below; no re-exec, whatever BLAS
# runs.
quick_run, results = quick_run_fixtures(lambda out: bench.run_bench(_args(out), reexec=False))


def test_the_quick_run_writes_its_files_and_prints_the_table(quick_run: tuple[Path, int, str]) -> None:
    out, code, stdout = quick_run
    assert code == 0
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert md.startswith("# mlxq bench\n")
    assert "| N | raw tok/s | queue tok/s | gateway tok/s | queue/raw | gateway/raw " \
           "| TTFT p50 ms raw / queue / gateway |" in md
    assert md.strip() in stdout
    assert (out / "logs" / "worker.log").exists() and (out / "logs" / "gateway.log").exists()


def test_raw_queue_and_gateway_side_by_side_at_every_n(results: dict[str, Any]) -> None:
    cfg = results["config"]
    assert (cfg["quick"], cfg["concurrency"], cfg["max_tokens"], cfg["model"]) == (True, [1, 4], 16, None)
    assert Path(results["model"]).name.startswith("tiny")  # the generated tiny model on a quick run
    assert results["machine"]["blas"] and results["machine"]["cpus"] >= 1 and results["seconds"] > 0
    assert [r["n"] for r in results["rows"]] == [1, 4]
    for row in results["rows"]:
        for path in ("raw", "queue", "gateway"):
            p = row[path]
            assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"]) and p["tok_s"] == max(p["runs_tok_s"])
            assert len(p["runs_tok_s"]) == cfg["repeats"] and p["ttft_samples"] == row["n"] * cfg["repeats"]
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
            # Greedy, no EOS from the random model: every request runs to max_tokens on every path.
            assert p["tokens"] == row["n"] * cfg["max_tokens"]
        # One run per path: the median of the paired ratios is the ratio of the two runs.
        assert row["queue_over_raw"] == pytest.approx(row["queue"]["tok_s"] / row["raw"]["tok_s"])
        assert row["gateway_over_raw"] == pytest.approx(row["gateway"]["tok_s"] / row["raw"]["tok_s"])


def test_the_command_measures_the_model_it_is_given(tiny_model: Path, tmp_path: Path) -> None:
    # As a user runs it (re-executing itself with OpenBLAS where that is installed), on a model directory.
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "mlxq.api.cli", "bench", "--quick", "--model", str(tiny_model),
                           "--concurrency", "2", "--max-tokens", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["model"] == data["config"]["model"] == str(tiny_model)
    ((row),) = data["rows"]
    assert row["n"] == 2 and row["raw"]["tokens"] == row["queue"]["tokens"] == 8
    assert f"Model `{tiny_model}`" in done.stdout and "| 2 |" in done.stdout
    assert "BLAS:" in done.stderr  # it says which BLAS runs (and that it preloads OpenBLAS, where it does)


def test_a_model_that_cannot_load_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    assert bench.run_bench(_args(tmp_path, model=str(missing)), reexec=False) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"mlxq bench: failed: no model directory at {missing}"


# --- fast: configuration, the re-exec, the HTTP client ---------------------------------------------
def test_config_defaults_quick_and_overrides(tmp_path: Path) -> None:
    full = bench.BenchConfig.from_args(_args(tmp_path, quick=False))
    assert (full.model, full.concurrency, full.max_tokens, full.capacity) == (None, (1, 8, 32), 64, 32)
    over = bench.BenchConfig.from_args(_args(tmp_path, model="org/model", concurrency="16,2,2", max_tokens=5))
    assert (over.model, over.concurrency, over.max_tokens, over.quick) == ("org/model", (2, 16), 5, True)


@pytest.mark.parametrize("over", [{"concurrency": "0"}, {"concurrency": ","}, {"max_tokens": -1}])
def test_a_bad_option_is_exit_code_2(tmp_path: Path, over: dict[str, Any]) -> None:
    assert bench.run_bench(_args(tmp_path, **over), reexec=False) == 2


def test_the_product_bench_is_small_and_its_research_lives_in_tests_perf() -> None:
    # The research phases (scheduling, images, two models, kernel policies, mlx_lm.server, the targets) are
    # `python3 -m tests.perf`; the installed package keeps the user's benchmark only.
    files = {f.name for f in (ROOT / "worker" / "tools" / "bench").glob("*.py")}
    assert files == {"__init__.py", "chart.py", "http.py", "paths.py", "preload.py", "report.py", "runs.py"}
    assert sum(len((ROOT / "worker" / "tools" / "bench" / f).read_text().splitlines()) for f in files) < 900


def test_reexec_runs_the_same_command_with_openblas_preloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(preload, "OPENBLAS", lib)
    monkeypatch.setattr(preload.sys, "platform", "linux")
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, list(argv), dict(env))))
    monkeypatch.delenv("MLXQ_BENCH_REEXEC", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    # The exec is recorded, not made: the command goes on, and exits 2 at its bad N.
    assert bench.run_bench(_args(tmp_path / "o", quick=False, model="m", concurrency="0", max_tokens=7)) == 2
    ((_, argv, env),) = calls
    assert argv[1:3] == ["-m", "mlxq.api.cli"]
    parsed = _parser().parse_args(argv[3:])
    assert (parsed.command, parsed.out, parsed.quick, parsed.model, parsed.concurrency, parsed.max_tokens) == (
        "bench", str(tmp_path / "o"), False, "m", "0", 7)
    assert env["LD_PRELOAD"].split() == [str(lib), "/other.so"] and env["MLXQ_BENCH_REEXEC"] == "1"
    calls.clear()
    monkeypatch.setenv("LD_PRELOAD", str(lib))  # already preloaded: no second exec
    preload.reexec_with_openblas(["-m", "mlxq.api.cli", "bench"])
    assert calls == []


def test_reexec_names_openblas_kernels_when_it_fell_back_to_generic_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    calls: list[dict[str, str]] = []
    monkeypatch.setattr(preload, "OPENBLAS", lib)
    monkeypatch.setattr(preload.sys, "platform", "linux")
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append(dict(env)))
    monkeypatch.setattr(preload, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512cd", "avx512bw",
                                                               "avx512dq", "avx512vl"}))
    monkeypatch.delenv("MLXQ_BENCH_REEXEC", raising=False)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setenv("LD_PRELOAD", str(lib))  # preloaded already, but on the generic kernels: exec once more
    monkeypatch.setattr(preload, "openblas_core", lambda path: "Prescott")
    preload.reexec_with_openblas(["-m", "mlxq.api.cli", "bench"])
    (env,) = calls
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX" and env["LD_PRELOAD"] == str(lib)
    calls.clear()
    monkeypatch.setattr(preload, "openblas_core", lambda path: "SkylakeX")  # it knows the CPU: nothing to do
    preload.reexec_with_openblas(["-m", "mlxq.api.cli", "bench"])
    monkeypatch.setattr(preload, "openblas_core", lambda path: "Prescott")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # the operator's choice stands
    preload.reexec_with_openblas(["-m", "mlxq.api.cli", "bench"])
    assert calls == []


def test_coretype_for_takes_the_fastest_kernels_the_cpu_flags_allow(tmp_path: Path) -> None:
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
    assert blas.coretype_for("Prescott", avx512) == "SkylakeX"
    assert blas.coretype_for("Prescott", frozenset({"sse3", "avx", "avx2", "fma"})) == "Haswell"
    assert blas.coretype_for("Prescott", frozenset({"sse3"})) is None  # generic is all it can run
    assert blas.coretype_for("Haswell", avx512) is None  # a kernel set it chose for a CPU it knows
    assert blas.coretype_for(None, avx512) is None  # no OpenBLAS
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse3 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert blas.cpu_flags(cpuinfo) == {"fpu", "sse3", "avx2"}
    assert blas.cpu_flags(tmp_path / "missing") == frozenset()
    assert blas.openblas_core(tmp_path / "missing.so") is None


class SseServer:
    """A loopback server that answers every POST as the gateway streams a completion (chunked SSE, then
    [DONE]), on keep-alive connections; ``close_after`` responses, it closes the connection (as a server does
    with one idle past its keep-alive timeout)."""

    def __init__(self, close_after: int = 0) -> None:
        self.connections = 0
        self.requests = 0
        self.close_after = close_after

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for data in (b'{"id":"cmpl-j1","choices":[{"text":"hi"}]}',
                             b'{"id":"cmpl-j1","choices":[],"usage":{"completion_tokens":1}}',
                             b"[DONE]"):
                    frame = b"data: %s\n\n" % data
                    writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                served += 1
                if served == self.close_after:
                    break
        writer.close()


async def _two_streams(server: SseServer) -> SseClient:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    http = SseClient("127.0.0.1", listening.sockets[0].getsockname()[1])
    try:
        for _ in range(2):
            trace = await stream(http, "tiny", "hello", 1)
            assert trace.tokens == 1 and trace.first_token is not None and trace.ended is not None
            assert trace.rid == "j1"  # the job's id, from the chunk's "cmpl-<id>": its TTFT splits at the worker
    finally:
        await http.aclose()
        listening.close()
        await listening.wait_closed()
    return http


async def test_the_bench_http_client_reuses_its_connection_for_the_next_request() -> None:
    server = SseServer()
    http = await _two_streams(server)
    assert (server.requests, server.connections, http.opened) == (2, 1, 1)


async def test_the_bench_http_client_opens_a_new_connection_when_the_server_closed_the_idle_one() -> None:
    server = SseServer(close_after=1)
    http = await _two_streams(server)
    assert (server.requests, server.connections, http.opened) == (2, 2, 2)
