"""``mlxq gateway``: the app served by uvicorn, in one process or several sharing the port."""

from __future__ import annotations

import copy
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.config import LOGGING_CONFIG

from .app import create_app
from .config import GatewayConfig

__all__ = ["app_from_env", "log_config", "serve"]

_GRACEFUL_S = 5  # on SIGTERM, open streams end (their jobs cancelled) and requests get this long to finish


def serve(config: GatewayConfig, *, workers: int = 1, log_level: str = "info", app: Starlette | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status. ``workers`` > 1 runs that many processes on the
    same port (each with its own queue client), as separate ``mlxq gateway`` processes behind a balancer would.
    ``app``: another app to serve in one process (``mlxq dashboard``'s)."""
    common = {"host": config.host, "port": config.port, "log_level": log_level, "access_log": False,
              "timeout_graceful_shutdown": _GRACEFUL_S, "log_config": log_config(log_level)}
    if workers > 1:  # each process builds its app from the environment, as this one read its config
        uvicorn.run("mlxq.api.gateway.server:app_from_env", factory=True, workers=workers, **common)  # type: ignore[arg-type]
    else:
        uvicorn.run(app or create_app(config), **common)  # type: ignore[arg-type]
    return 0


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
