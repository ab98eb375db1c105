"""Producer configuration, read once from the environment (prefix ``MLXQ_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ClientConfig"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_RETRY_DEADLINE_S = 5.0
DEFAULT_MAX_QUEUED = 10_000
DEFAULT_JOB_EXPIRY_S = 300.0
DEFAULT_PRIORITY_AGING_S = 1.0


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the queue lives and how the client talks to it."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "mlxq"
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S  # how long an operation retries an unreachable Redis
    max_queued: int = DEFAULT_MAX_QUEUED  # jobs one model's queue may hold before submits raise QueueFull (0: no cap)
    job_expiry_s: float = DEFAULT_JOB_EXPIRY_S  # a job still queued this long ends error(expired) (0: never)
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S  # waiting time one priority level is worth

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        """``MLXQ_REDIS_URL``, ``MLXQ_PREFIX``, ``MLXQ_RETRY_DEADLINE``, ``MLXQ_MAX_QUEUED``, ``MLXQ_JOB_EXPIRY``
        and ``MLXQ_PRIORITY_AGING`` (seconds)."""
        env = os.environ if env is None else env
        return cls(
            redis_url=env.get("MLXQ_REDIS_URL", DEFAULT_REDIS_URL),
            prefix=env.get("MLXQ_PREFIX", "mlxq"),
            retry_deadline_s=float(env.get("MLXQ_RETRY_DEADLINE", DEFAULT_RETRY_DEADLINE_S)),
            max_queued=int(env.get("MLXQ_MAX_QUEUED", DEFAULT_MAX_QUEUED)),
            job_expiry_s=float(env.get("MLXQ_JOB_EXPIRY", DEFAULT_JOB_EXPIRY_S)),
            priority_aging_s=float(env.get("MLXQ_PRIORITY_AGING", DEFAULT_PRIORITY_AGING_S)),
        )
