"""Run ``arq worker.Settings`` in a child process, as an operator would: for the demo, benchmarks and tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import redis

__all__ = ["WorkerProcess"]

_ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A worker subprocess configured by ``MLXQ_*`` variables; its log goes to ``log_path``."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self.env = {**os.environ, **env}
        self.env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arq", "worker.Settings"],
                env=self.env, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the worker's health-check key appears (it has loaded its model and polls)."""
        prefix = self.env.get("MLXQ_PREFIX", "mlxq")
        name = self.env.get("MLXQ_MODEL_NAME") or self.env["MLXQ_MODEL"]
        pattern = f"{prefix}:queue:{name}:health:*"
        client = redis.Redis.from_url(self.env["MLXQ_REDIS_URL"])
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early; log:\n{self.tail()}")
                if any(True for _ in client.scan_iter(match=pattern, count=1000)):
                    return
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"worker not ready after {timeout}s; log:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
