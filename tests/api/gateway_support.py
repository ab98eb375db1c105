"""A real deployment for the gateway's tests: a private Redis, worker processes on the tiny model, and gateways
served by uvicorn on free loopback ports (each in a thread with its own event loop), as clients meet them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from mlxq.api.config import ClientConfig
from mlxq.api.gateway import GatewayConfig, create_app
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

PREFIX = "gw"


class ServedGateway:
    """The gateway app served by uvicorn on a free loopback port, in a thread of its own."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name="gateway", daemon=True)

    def start(self) -> ServedGateway:
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < end, "the gateway did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class Deployment:
    """A Redis of its own, workers (child processes, as operators run them) and gateways in front of them."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.redis = RedisServer().start()
        self.workers: list[WorkerProcess] = []
        self.config = GatewayConfig(client=ClientConfig(redis_url=self.redis.url, prefix=PREFIX))

    def worker(self, name: str = "tiny", **env: str) -> WorkerProcess:
        """Start a worker serving the tiny model as ``name``; returns once it polls."""
        base = {"MLXQ_MODEL": str(self.model), "MLXQ_MODEL_NAME": name, "MLXQ_REDIS_URL": self.redis.url,
                "MLXQ_PREFIX": PREFIX, "MLXQ_BATCH_CAPACITY": "8", "MLXQ_CANCEL_POLL": "0.1",
                "MLXQ_REAP_INTERVAL": "0.2", "OPENBLAS_NUM_THREADS": "1"}
        proc = WorkerProcess({**base, **env}, self.workdir / f"worker-{name}-{len(self.workers)}.log").start()
        self.workers.append(proc)
        proc.wait_ready()
        return proc

    @contextlib.contextmanager
    def gateway(self, **changes: Any) -> Iterator[ServedGateway]:
        """A gateway on this deployment; ``changes`` replace fields of its config (``client`` takes a dict)."""
        client = dataclasses.replace(self.config.client, **changes.pop("client", {}))
        served = ServedGateway(create_app(dataclasses.replace(self.config, client=client, **changes))).start()
        try:
            yield served
        finally:
            served.stop()

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.redis.close()


@contextlib.contextmanager
def deployment(model: Path, workdir: Path, **worker_env: str) -> Iterator[tuple[Deployment, ServedGateway]]:
    """A deployment with one worker serving ``tiny`` and one gateway in front of it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    d = Deployment(model, workdir)
    try:
        d.worker("tiny", **worker_env)
        with d.gateway() as served:
            yield d, served
    finally:
        d.close()


@contextlib.contextmanager
def embed_and_chat(embed_model: Path, chat_model: Path, workdir: Path) -> Iterator[tuple[Deployment, ServedGateway]]:
    """Two workers (``embed`` serving an embedding model, ``chat`` a chat model) and one gateway in front."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    d = Deployment(embed_model, workdir)
    try:
        d.worker("embed")
        d.worker("chat", MLXQ_MODEL=str(chat_model))
        with d.gateway() as served:
            yield d, served
    finally:
        d.close()


async def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    """One request with a plain HTTP client (what the SDKs would not send)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post(path, json=body, **kwargs)


async def occupy(d: Deployment, model: str = "tiny", n: int = 12) -> list[str]:
    """Fill the workers' batches with ``n`` long jobs, so the next job waits queued behind them (the caller
    cancels them, by the ids returned)."""
    from mlxq.api.client import Client

    async with Client(d.redis.url, prefix=PREFIX) as client:
        return [await client.submit(model=model, prompt="busy", max_tokens=500) for _ in range(n)]


async def release(d: Deployment, ids: list[str]) -> None:
    """Cancel the jobs :func:`occupy` queued."""
    from mlxq.api.client import Client

    async with Client(d.redis.url, prefix=PREFIX) as client:
        for rid in ids:
            await client.cancel(rid)
