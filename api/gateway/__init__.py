"""The HTTP gateway: OpenAI's and Anthropic's APIs in front of the queue (``mlxq gateway``; the ``gateway`` extra).

Any number of workers behind one endpoint, any stock client unchanged. The gateway is producer-side code: it
submits jobs and follows their events through :class:`api.client.Client`, and keeps nothing of its own, so
several gateway processes may serve side by side. Its app needs Starlette and uvicorn (its event streams are
its own, ``sse.py``), loaded on first use of :func:`create_app` or :class:`Gateway` (its config is plain, so a
command can read it first); nothing else in ``api`` imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GatewayConfig

if TYPE_CHECKING:
    from .app import Gateway, create_app

__all__ = ["Gateway", "GatewayConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("Gateway", "create_app"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
