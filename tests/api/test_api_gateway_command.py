"""`mlxq gateway`'s listening address: its options win over MLXQ_GATEWAY_HOST/PORT, and --port 0 means any free
port (it used to mean MLXQ_GATEWAY_PORT or 8000)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def gateway(redis_url: str, *options: str, env: dict[str, str]) -> Iterator[int]:
    """``mlxq gateway`` with these options; yields the port uvicorn says it listens on, then stops it."""
    full = {**os.environ, "MLXQ_REDIS_URL": redis_url, **env}
    proc = subprocess.Popen([sys.executable, "-m", "mlxq.api.cli", "gateway", *options], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        seen = []
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
