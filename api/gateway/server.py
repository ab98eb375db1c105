"""``mlxq gateway``: the app served by uvicorn, in one process or several sharing the port."""

from __future__ import annotations

import logging

import uvicorn
from starlette.applications import Starlette

from .app import create_app
from .config import GatewayConfig

__all__ = ["app_from_env", "serve"]

_GRACEFUL_S = 5  # on SIGTERM, open streams end (their jobs cancelled) and requests get this long to finish


def serve(config: GatewayConfig, *, workers: int = 1, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status. ``workers`` > 1 runs that many processes on the
    same port (each with its own queue client), as separate ``mlxq gateway`` processes behind a balancer would."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sse_starlette").setLevel(max(logging.INFO, logging.getLogger().level))  # a line per chunk
    common = {"host": config.host, "port": config.port, "log_level": log_level, "access_log": False,
              "timeout_graceful_shutdown": _GRACEFUL_S}
    if workers > 1:  # each process builds its app from the environment, as this one read its config
        uvicorn.run("api.gateway.server:app_from_env", factory=True, workers=workers, **common)  # type: ignore[arg-type]
    else:
        uvicorn.run(create_app(config), **common)  # type: ignore[arg-type]
    return 0


def app_from_env() -> Starlette:
    """The app configured from ``MLXQ_*`` variables (uvicorn's factory for several worker processes)."""
    return create_app(GatewayConfig.from_env())
