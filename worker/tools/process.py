"""Run ``arq mlxq.worker.Settings`` (and ``mlxq gateway``) in a child process, as an operator would: for the demo,
benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import redis
import redis.sentinel

from mlxq.api.connection import sentinel_url
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import ModelState, WorkerStatus

from .redis_server import free_port

__all__ = ["GatewayProcess", "WorkerProcess"]

_ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A worker subprocess configured by ``MLXQ_*`` variables; its log goes to ``log_path``. ``settings``: the arq
    settings it runs (a benchmark's simulated worker names its own)."""

    def __init__(self, env: Mapping[str, str], log_path: Path, settings: str = "mlxq.worker.Settings") -> None:
        self.env = {**os.environ, **env}
        self.settings = settings
        self.env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arq", self.settings],
                env=self.env, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self, timeout: float = 120.0) -> WorkerStatus:
        """Block until the worker's health record shows every model it serves loaded (or, loaded on demand, ready
        to load); returns that record."""
        keys = Keys(self.env.get("MLXQ_PREFIX", "mlxq"))
        end = time.monotonic() + timeout
        with _sync_client(self.env["MLXQ_REDIS_URL"]) as client:
            while time.monotonic() < end:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited early; log:\n{self.tail()}")
                status = self._status(client, keys)
                if status is not None and all(m.state is ModelState.SERVING or m.state is ModelState.UNLOADED
                                              for m in status.models):  # (unloaded: loaded on demand)
                    return status
                time.sleep(0.05)
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


@contextlib.contextmanager
def _sync_client(url: str) -> Iterator[redis.Redis]:
    """A blocking client of the Redis ``url`` names: one server, or a Sentinel set's master (the sentinels'
    connections closed with it)."""
    found = sentinel_url(url)
    if found is None:
        client = redis.Redis.from_url(url)
        try:
            yield client
        finally:
            client.close()
        return
    sentinel = redis.sentinel.Sentinel(
        list(found.sentinels), sentinel_kwargs={"username": found.sentinel_username,
                                                "password": found.sentinel_password},
        db=found.db, username=found.username, password=found.password, ssl=found.ssl)
    master = sentinel.master_for(found.master)
    try:
        yield master
    finally:
        master.close()
        for node in sentinel.sentinels:
            node.close()


class GatewayProcess:
    """``mlxq gateway`` in a subprocess on a free loopback port (``url``), configured by ``MLXQ_*`` variables;
    its log goes to ``log_path``. Needs the gateway extra."""

    def __init__(self, env: Mapping[str, str], log_path: Path, port: int | None = None) -> None:
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlxq.api.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "warning"],
                env=self.env, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until ``GET /health`` answers 200 (the gateway listens and reaches Redis)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited early; log:\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused (not listening yet), or a 503 (Redis not answering yet)
                pass
            time.sleep(0.05)
        raise RuntimeError(f"gateway not ready after {timeout}s; log:\n{_tail(self.log_path)}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (open streams end, their jobs cancelled), then SIGKILL if it does not exit in ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
