"""Producer configuration, read once from the environment (prefix ``MLXQ_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ClientConfig"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_RETRY_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the queue lives and how the client talks to it."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "mlxq"
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S  # how long an operation retries an unreachable Redis

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        """``MLXQ_REDIS_URL``, ``MLXQ_PREFIX`` and ``MLXQ_RETRY_DEADLINE`` (seconds)."""
        env = os.environ if env is None else env
        return cls(
            redis_url=env.get("MLXQ_REDIS_URL", DEFAULT_REDIS_URL),
            prefix=env.get("MLXQ_PREFIX", "mlxq"),
            retry_deadline_s=float(env.get("MLXQ_RETRY_DEADLINE", DEFAULT_RETRY_DEADLINE_S)),
        )
