"""Producer configuration, read once from the environment (prefix ``MLXQ_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError
from .schema import job_bytes_limit

__all__ = ["ClientConfig", "EnvReader"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_RETRY_DEADLINE_S = 5.0
DEFAULT_MAX_QUEUED = 10_000
DEFAULT_JOB_EXPIRY_S = 300.0
DEFAULT_PRIORITY_AGING_S = 1.0
# What workers accept (the worker's config reads the same variables with these defaults): the producer checks
# a job against them before queueing it, so it never queues a job every worker would refuse, nor refuses one
# they take.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
DEFAULT_MAX_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class EnvReader:
    """Typed reads of ``MLXQ_*`` variables: a value that does not parse raises :class:`ConfigError` naming it."""

    env: Mapping[str, str]

    def text(self, name: str, default: str) -> str:
        return self.env.get(name, default)

    def flag(self, name: str, default: bool) -> bool:
        raw = self.env.get(name)
        if raw is None or not raw.strip():
            return default
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")

    def integer(self, name: str, default: int, minimum: int | None = None) -> int:
        return int(self._number(name, default, int, minimum))

    def number(self, name: str, default: float, minimum: float | None = None) -> float:
        return float(self._number(name, default, float, minimum))

    def optional_number(self, name: str, minimum: float | None = None) -> float | None:
        """A number, or None when unset."""
        raw = self.env.get(name)
        return None if raw is None or not raw.strip() else self.number(name, 0.0, minimum)

    def _number(self, name: str, default: float, kind: type, minimum: float | None) -> float:
        raw = self.env.get(name)
        if raw is None or not raw.strip():
            return default
        what = "an integer" if kind is int else "a number"
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected {what}") from None
        if value != value or (minimum is not None and value < minimum):  # NaN, or below the bound
            raise ConfigError(f"{name}={raw!r}: expected {what} >= {minimum:g}")
        return float(value)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the queue lives and how the client talks to it."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "mlxq"
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S  # how long an operation retries an unreachable Redis
    max_queued: int = DEFAULT_MAX_QUEUED  # jobs one model's queue may hold before submits raise QueueFull (0: no cap)
    job_expiry_s: float = DEFAULT_JOB_EXPIRY_S  # a job still queued this long ends error(expired) (0: never)
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S  # waiting time one priority level is worth
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # a job's JSON without images, as workers read it
    max_images: int = DEFAULT_MAX_IMAGES  # images in one job
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image file

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        """``MLXQ_REDIS_URL``, ``MLXQ_PREFIX``, ``MLXQ_RETRY_DEADLINE``, ``MLXQ_MAX_QUEUED``, ``MLXQ_JOB_EXPIRY``
        and ``MLXQ_PRIORITY_AGING`` (seconds); and the workers' job limits ``MLXQ_MAX_PAYLOAD_BYTES``,
        ``MLXQ_MAX_IMAGES`` and ``MLXQ_MAX_IMAGE_BYTES``."""
        e = EnvReader(os.environ if env is None else env)
        return cls(
            redis_url=e.text("MLXQ_REDIS_URL", DEFAULT_REDIS_URL),
            prefix=e.text("MLXQ_PREFIX", "mlxq"),
            retry_deadline_s=e.number("MLXQ_RETRY_DEADLINE", DEFAULT_RETRY_DEADLINE_S, minimum=0),
            max_queued=e.integer("MLXQ_MAX_QUEUED", DEFAULT_MAX_QUEUED, minimum=0),
            job_expiry_s=e.number("MLXQ_JOB_EXPIRY", DEFAULT_JOB_EXPIRY_S, minimum=0),
            priority_aging_s=e.number("MLXQ_PRIORITY_AGING", DEFAULT_PRIORITY_AGING_S, minimum=0),
            max_payload_bytes=e.integer("MLXQ_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES, minimum=1),
            max_images=e.integer("MLXQ_MAX_IMAGES", DEFAULT_MAX_IMAGES, minimum=0),
            max_image_bytes=e.integer("MLXQ_MAX_IMAGE_BYTES", DEFAULT_MAX_IMAGE_BYTES, minimum=1),
        )

    @property
    def max_job_bytes(self) -> int:
        """The largest job (JSON) workers read: the payload limit and room for the most and largest images."""
        return job_bytes_limit(self.max_payload_bytes, self.max_images, self.max_image_bytes)
