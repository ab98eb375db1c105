"""The HTTP gateway: OpenAI's and Anthropic's APIs in front of the queue (``mlxq gateway``; the ``gateway`` extra).

Any number of workers behind one endpoint, any stock client unchanged. The gateway is producer-side code: it
submits jobs and follows their events through :class:`api.client.Client`, and keeps nothing of its own, so
several gateway processes may serve side by side. Importing it needs Starlette, sse-starlette and uvicorn;
nothing else in ``api`` imports it.
"""

from __future__ import annotations

from .app import Gateway, create_app
from .config import GatewayConfig

__all__ = ["Gateway", "GatewayConfig", "create_app"]
