"""mlxq's worker: joins the engine to Redis and arq. ``arq mlxq.worker.Settings`` runs one."""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["Settings"]

if __name__ == "worker":  # `arq worker.Settings` from a checkout: the installed package, under its one name
    sys.modules[__name__] = importlib.import_module("mlxq.worker")


def __getattr__(name: str) -> Any:
    # Lazy: importing the package loads no MLX until arq asks for Settings.
    if name == "Settings":
        from .settings import Settings

        return Settings
    raise AttributeError(name)
