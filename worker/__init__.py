"""mlxq's worker: joins the engine to Redis and arq. ``arq worker.Settings`` runs one."""

from __future__ import annotations

from typing import Any

__all__ = ["Settings"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package loads no MLX until arq asks for Settings.
    if name == "Settings":
        from .settings import Settings

        return Settings
    raise AttributeError(name)
