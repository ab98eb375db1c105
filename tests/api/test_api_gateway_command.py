"""`mlxq gateway`'s listening address: its options win over MLXQ_GATEWAY_HOST/PORT, and --port 0 means any free
port (it used to mean MLXQ_GATEWAY_PORT or 8000)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def gateway(redis_url: str, *options: str, env: dict[str, str], seen: list[str] | None = None) -> Iterator[int]:
    """``mlxq gateway`` with these options; yields the port uvicorn says it listens on (its lines until then
    into ``seen``), then stops it."""
    full = {**os.environ, "MLXQ_REDIS_URL": redis_url, **env}
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.api.cli", "gateway", *options], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        seen = [] if seen is None else seen
        for line in proc.stdout:  # ends if the process does
            seen.append(line)
            running = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ", line)
            if running:
                yield int(running.group(1))
                break
        else:
            raise AssertionError(f"the gateway exited ({proc.wait()}):\n{''.join(seen)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
        return int(resp.status)


def test_host_and_port_options_win_over_the_environment(redis_url: str) -> None:
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        env = {"MLXQ_GATEWAY_HOST": "127.0.0.2", "MLXQ_GATEWAY_PORT": str(taken.getsockname()[1])}
        with gateway(redis_url, "--host", "127.0.0.1", "--port", str(port), env=env) as listening:
            assert listening == port
            assert health(port) == 200


def test_port_0_listens_on_any_free_port(redis_url: str) -> None:
    with socket.socket() as taken:  # where MLXQ_GATEWAY_PORT points: binding there would fail
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"MLXQ_GATEWAY_HOST": "127.0.0.1", "MLXQ_GATEWAY_PORT": str(taken.getsockname()[1])}
        with gateway(redis_url, "--port", "0", env=env) as listening:
            assert listening not in (0, 8000, taken.getsockname()[1])
            assert health(listening) == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", ["gateway", "dashboard"])
def test_a_taken_port_is_one_line_and_its_own_exit_status(command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "mlxq.api.cli", command, "--port", str(port)], cwd=ROOT,
                              env={**os.environ, "MLXQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}"},
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4  # not 3, the CLI's "no live worker"
    assert proc.stderr == f"mlxq: cannot listen on 127.0.0.1:{port}: Address already in use\n", proc.stderr


def test_a_redis_that_does_not_answer_is_one_warning_at_start_and_the_gateway_serves() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    seen: list[str] = []
    with gateway(url, "--port", "0", env={}, seen=seen) as port, pytest.raises(urllib.error.HTTPError) as down:
        health(port)  # it serves, and says Redis is down
    assert down.value.code == 503
    warned = [line for line in seen if "WARNING" in line]
    assert len(warned) == 1 and f"Redis at {url} did not answer" in warned[0] and "serving anyway" in warned[0]
