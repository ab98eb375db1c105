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

from api.keys import Keys
from api.schema import ModelState, WorkerStatus

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

    def wait_ready(self, timeout: float = 120.0) -> WorkerStatus:
        """Block until the worker's health record shows every model it serves loaded; returns that record."""
        keys = Keys(self.env.get("MLXQ_PREFIX", "mlxq"))
        client = redis.Redis.from_url(self.env["MLXQ_REDIS_URL"])
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early; log:\n{self.tail()}")
                status = self._status(client, keys)
                if status is not None and all(m.state is ModelState.SERVING for m in status.models):
                    return status
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"worker not ready after {timeout}s; log:\n{self.tail()}")

    def _status(self, client: redis.Redis, keys: Keys) -> WorkerStatus | None:
        """This process's health record, if it wrote one."""
        assert self.proc is not None
        ids = [i.decode() for i in client.zrange(keys.workers(), 0, -1)]  # type: ignore[union-attr]
        for raw in client.mget([keys.worker(i) for i in ids]) if ids else []:  # type: ignore[union-attr]
            if raw is not None:
                status = WorkerStatus.model_validate_json(raw)
                if status.pid == self.proc.pid:
                    return status
        return None

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
