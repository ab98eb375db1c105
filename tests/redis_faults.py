"""Redis faults for the tests: a Sentinel set of real processes on loopback, and a TCP proxy that delays and
stalls Redis's replies. Both bounded: every wait has a timeout, and each stops what it started."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from mlxq.worker.tools.redis_server import find_redis_server
from tests.support import free_port

MASTER = "mymaster"


@dataclass(slots=True)
class Node:
    """One redis-server process (a data node or a sentinel) on a loopback port."""

    port: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)


@dataclass(slots=True)
class SentinelSet:
    """A master, one replica and three sentinels (quorum 2) watching them as ``MASTER``; failover after
    ``down_after_ms`` of silence."""

    root: Path
    down_after_ms: int = 1000
    nodes: list[Node] = field(default_factory=list)

    @property
    def master(self) -> Node:
        return self.nodes[0]

    @property
    def replica(self) -> Node:
        return self.nodes[1]

    @property
    def sentinels(self) -> list[Node]:
        return self.nodes[2:]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER}"

    def start(self) -> SentinelSet:
        binary = find_redis_server()
        m_port, r_port = free_port(), free_port()
        for name, port, extra in (("master", m_port, []), ("replica", r_port, ["--replicaof", "127.0.0.1",
                                                                                  str(m_port)])):
            d = self.root / name
            d.mkdir(parents=True)
            self.nodes.append(Node(port, [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                                          "--save", "", "--appendonly", "no", "--logfile", str(d / "redis.log"),
                                          *extra]))
        for i in range(3):
            d, port = self.root / f"sentinel{i}", free_port()
            d.mkdir()
            conf = d / "sentinel.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                            f"sentinel monitor {MASTER} 127.0.0.1 {m_port} 2\n"
                            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {MASTER} 4000\n")
            self.nodes.append(Node(port, [binary, str(conf), "--sentinel"]))
        for node in self.nodes:
            node.start()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the replica is in sync and every sentinel sees the replica and the other sentinels."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(redis.RedisError, OSError):
                info = self.replica.client().info("replication")
                if info.get("master_link_status") == "up" and all(self._sees_all(s) for s in self.sentinels):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the Sentinel set did not settle within {timeout}s (logs under {self.root})")

    @staticmethod
    def _sees_all(sentinel: Node) -> bool:
        state = sentinel.client().sentinel_master(MASTER)
        return int(state.get("num-slaves", 0)) >= 1 and int(state.get("num-other-sentinels", 0)) >= 2

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers names it."""
        for s in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError):
                found = s.client().sentinel_get_master_addr_by_name(MASTER)
                if found:
                    return int(found[1])
        raise RuntimeError("no sentinel answers")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()


class FaultProxy:
    """A loopback TCP proxy in front of ``upstream_port``: each chunk of Redis's replies is held ``delay_s``
    before it is passed on, and :meth:`stall` holds every byte, both ways, for a while. Each connection is
    forwarded by two tasks that end with it; :meth:`close` ends them all."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stall(self, seconds: float) -> None:
        """Hold all traffic for ``seconds``, then let it through again."""
        self._open.clear()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.upstream_port), 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        for src, dst, delayed in ((reader, up_writer, False), (up_reader, writer, True)):
            task = asyncio.create_task(self._pipe(src, dst, delayed))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, delayed: bool) -> None:
        try:
            while data := await src.read(65536):
                if delayed and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._open.wait()
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
