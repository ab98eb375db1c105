"""Producer configuration, read once from the environment (prefix ``MLXQ_``); each variable is declared once,
on its field (``api/settings.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .schema import job_bytes_limit
from .settings import parse_redis_url, read, setting

__all__ = ["ClientConfig", "ToolConfig"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
DEFAULT_RETRY_DEADLINE_S = 5.0
DEFAULT_MAX_QUEUED = 10_000
DEFAULT_JOB_EXPIRY_S = 300.0
DEFAULT_PRIORITY_AGING_S = 1.0
# What workers accept (the worker's config declares the same variables: shared()): the producer checks a job
# against them before queueing it, so it never queues a job every worker would refuse, nor refuses one they take.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
DEFAULT_MAX_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the queue lives and how the client talks to it."""

    redis_url: str = setting("MLXQ_REDIS_URL", DEFAULT_REDIS_URL, "the Redis to use; also "
                             "rediss://HOST:PORT, unix:///path/redis.sock, or a Sentinel set: "
                             "redis+sentinel://HOST:PORT,HOST:PORT/MASTER", parse=parse_redis_url)
    prefix: str = setting("MLXQ_PREFIX", "mlxq", "namespace of every key and channel under one Redis, arq's "
                          "included: separates deployments sharing a Redis")
    retry_deadline_s: float = setting("MLXQ_RETRY_DEADLINE", DEFAULT_RETRY_DEADLINE_S, "seconds an operation "
                                      "retries an unreachable Redis, from its start", minimum=0)
    max_queued: int = setting("MLXQ_MAX_QUEUED", DEFAULT_MAX_QUEUED, "jobs one model's queue may hold before "
                              "submits are refused (QueueFull, HTTP 429); 0: no cap", minimum=0)
    job_expiry_s: float = setting("MLXQ_JOB_EXPIRY", DEFAULT_JOB_EXPIRY_S, "seconds a job may wait queued before "
                                  "it ends error(expired); 0: never", minimum=0)
    priority_aging_s: float = setting("MLXQ_PRIORITY_AGING", DEFAULT_PRIORITY_AGING_S, "seconds of waiting one "
                                      "priority level is worth (producers and workers alike)", minimum=0)
    max_payload_bytes: int = setting("MLXQ_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES, "a job's JSON without "
                                     "its images, and its prompt's characters, checked before decoding → "
                                     "error(bad_request) (producers check it too)", minimum=1,
                                     shown="1 MiB")
    max_images: int = setting("MLXQ_MAX_IMAGES", DEFAULT_MAX_IMAGES, "images in one job; a job's JSON may exceed "
                              "the payload limit by this many images of the largest size", minimum=0)
    max_image_bytes: int = setting("MLXQ_MAX_IMAGE_BYTES", DEFAULT_MAX_IMAGE_BYTES, "one image's file (decoded "
                                   "from base64, or fetched)", minimum=1, shown="4 MiB")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        """The producer's variables (see the fields); unset ones keep their defaults, and a bad value raises
        :class:`~api.errors.ConfigError` naming its variable."""
        return cls(**read(cls, os.environ if env is None else env))

    @property
    def max_job_bytes(self) -> int:
        """The largest job (JSON) workers read: the payload limit and room for the most and largest images."""
        return job_bytes_limit(self.max_payload_bytes, self.max_images, self.max_image_bytes)


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """What the worker side's tools (``mlxq demo``, ``mlxq bench``) read beside the worker's settings; declared
    here, on the producer side, because the CLI's help names it."""

    model_cache: str = setting("MLXQ_MODEL_CACHE", "", "where the generated models are kept between runs",
                               shown="~/.cache/mlxq/models")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ToolConfig:
        """The tools' variables; unset ones keep their defaults."""
        return cls(**read(cls, os.environ if env is None else env))
