"""``mlxq gateway``: the app served by uvicorn, in one process or several sharing the port."""

from __future__ import annotations

import asyncio
import copy
import logging
import logging.config
import os
import socket
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.config import LOGGING_CONFIG

from ..client import Client
from ..errors import MlxqError
from .app import create_app
from .config import GatewayConfig

__all__ = ["CannotListen", "app_from_env", "log_config", "serve"]

log = logging.getLogger(__name__)

_GRACEFUL_S = 5  # on SIGTERM, open streams end (their jobs cancelled) and requests get this long to finish


class CannotListen(Exception):
    """The server cannot listen on its address (in use, not this host's) or did not start: one line."""


def serve(config: GatewayConfig, *, workers: int = 1, log_level: str = "info", app: Starlette | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status. ``workers`` > 1 runs that many processes on the
    same port (each with its own queue client), as separate ``mlxq gateway`` processes behind a balancer would.
    ``app``: another app to serve in one process (``mlxq dashboard``'s). Raises :class:`CannotListen` where
    the address is taken; a Redis that does not answer is a warning (it may come later; requests get 503)."""
    check_address(config.host, config.port)
    logging.config.dictConfig(log_config(log_level))
    _warn_unless_redis_answers(config)
    common = {"host": config.host, "port": config.port, "log_level": log_level, "access_log": False,
              "timeout_graceful_shutdown": _GRACEFUL_S, "log_config": log_config(log_level)}
    try:
        if workers > 1:  # each process builds its app from the environment, as this one read its config
            uvicorn.run("mlxq.api.gateway.server:app_from_env", factory=True, workers=workers, **common)  # type: ignore[arg-type]
        else:
            uvicorn.run(app or create_app(config), **common)  # type: ignore[arg-type]
    except SystemExit as exc:  # uvicorn's "startup failed" (3, the CLI's "no live worker"): its log says why
        if exc.code == 3:
            raise CannotListen(f"could not start on {config.host}:{config.port} (the log above says why)") from None
        raise
    return 0


def check_address(host: str, port: int) -> None:
    """Raise :class:`CannotListen` unless ``host:port`` can be bound now (port 0: any free one can), rather than
    let uvicorn log the error after the app started."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()  # SO_REUSEADDR, as uvicorn binds
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {why}") from None


def _warn_unless_redis_answers(config: GatewayConfig) -> None:
    async def ping() -> None:
        async with Client(config=config.client) as client:
            await client.ping()

    try:
        asyncio.run(ping())
    except MlxqError as exc:
        log.warning("%s; serving anyway (Redis may come later): requests get 503 until it answers", exc)


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, and mlxq's (``api.*``: a line per request at DEBUG) at ``level``; uvicorn applies it
    in every process it runs."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["mlxq"] = {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    config["handlers"]["mlxq"] = {"class": "logging.StreamHandler", "formatter": "mlxq", "stream": "ext://sys.stderr"}
    config["loggers"]["mlxq"] = {"handlers": ["mlxq"], "level": level.upper(), "propagate": False}
    return config


def app_from_env() -> Starlette:
    """The app configured from ``MLXQ_*`` variables (uvicorn's factory for several worker processes)."""
    return create_app(GatewayConfig.from_env())
