"""The gateway's configuration, read once from the environment (prefix ``MLXQ_``) and passed down as one object;
each variable is declared once, on its field (``api/settings.py``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import ClientConfig
from ..errors import ConfigError
from ..files import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_LINES
from ..files import DEFAULT_RETENTION_S as DEFAULT_FILE_RETENTION_S
from ..schema import TENANT_PATTERN
from ..settings import read, setting

__all__ = ["GatewayConfig"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# The largest job workers read with their default limits (MLXQ_MAX_PAYLOAD_BYTES, and room for MLXQ_MAX_IMAGES
# images of MLXQ_MAX_IMAGE_BYTES each): a bigger body could not be queued. From the environment, the limits set.
DEFAULT_MAX_BODY_BYTES = ClientConfig().max_job_bytes
DEFAULT_RESPONSE_RETENTION_S = 30 * 86_400  # stored responses: OpenAI keeps them 30 days
DEFAULT_BATCH_WINDOW = 256  # a batch's jobs in the queue at once: several workers' batches full
DEFAULT_COMPLETION_WINDOW_S = 86_400  # "24h"
DEFAULT_MAX_TOKENS = 512  # when a request names none (OpenAI's may not): mlx_lm.server's default


def _keys(name: str, raw: str) -> frozenset[str]:
    """The entries, each ``key`` or ``key=tenant``; a tenant name that is malformed is a :class:`ConfigError`
    (naming the entry's place, never the key). A key of base64 padding (``abc==``) names no tenant."""
    entries = [k.strip() for k in raw.split(",") if k.strip()]
    for i, entry in enumerate(entries, 1):
        key, sep, tenant = entry.rpartition("=")
        if sep and key and tenant and not re.match(TENANT_PATTERN, tenant):
            raise ConfigError(f"{name}: entry {i} names tenant {tenant[:80]!r}: a tenant name is 1 to 64 of "
                              "A-Z a-z 0-9 . _ -")
    return frozenset(entries)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How the gateway listens, whom it serves and what it accepts; ``client`` is its queue client's."""

    host: str = setting("MLXQ_GATEWAY_HOST", DEFAULT_HOST, "address `mlxq gateway` listens on (--host wins)")
    port: int = setting("MLXQ_GATEWAY_PORT", DEFAULT_PORT, "port `mlxq gateway` listens on (--port wins; 0: any "
                        "free one)", minimum=0)
    api_keys: frozenset[str] = setting("MLXQ_API_KEYS", frozenset(), "comma-separated keys a request must present "
                                       "(Bearer or x-api-key), each `key=tenant` to name whose jobs its requests "
                                       "are (none: the default tenant); unset: no authentication", parse=_keys)
    admin_keys: frozenset[str] = setting("MLXQ_ADMIN_KEYS", frozenset(), "comma-separated keys of the dashboard's "
                                         "admins: they see prompts and outputs, cancel jobs and retry dead letters; "
                                         "unset: the dashboard is read-only for everyone", parse=_keys)
    max_body_bytes: int = setting("MLXQ_GATEWAY_MAX_BODY", DEFAULT_MAX_BODY_BYTES, "largest request body in "
                                  "bytes → 413; unset, it follows MLXQ_MAX_PAYLOAD_BYTES, MLXQ_MAX_IMAGES and "
                                  "MLXQ_MAX_IMAGE_BYTES", minimum=1,
                                  shown=f"the largest job the workers' limits allow: {DEFAULT_MAX_BODY_BYTES} with "
                                        "their defaults")
    default_max_tokens: int = setting("MLXQ_GATEWAY_MAX_TOKENS", DEFAULT_MAX_TOKENS, "the most max_tokens "
                                      "of an OpenAI request that names none (the worker lowers it to what fits "
                                      "the context)", minimum=1)
    response_retention_s: int = setting("MLXQ_RESPONSE_RETENTION", DEFAULT_RESPONSE_RETENTION_S, "seconds a stored "
                                        "response (/v1/responses, store true) is kept in Redis after its last "
                                        "write (OpenAI keeps them 30 days)", minimum=60)
    batch_max_file_bytes: int = setting("MLXQ_BATCH_MAX_FILE_BYTES", DEFAULT_MAX_FILE_BYTES, "largest batch input "
                                        "file in bytes (/v1/files, purpose batch; kept in Redis) → 413",
                                        minimum=1)
    batch_max_lines: int = setting("MLXQ_BATCH_MAX_LINES", DEFAULT_MAX_LINES, "most requests (lines) in a batch "
                                   "input file → 400", minimum=1)
    file_retention_s: int = setting("MLXQ_FILE_RETENTION", DEFAULT_FILE_RETENTION_S, "seconds a file (a batch's "
                                    "input, output or errors) and a batch's record are kept in Redis", minimum=60)
    batch_window: int = setting("MLXQ_BATCH_WINDOW", DEFAULT_BATCH_WINDOW, "jobs of one batch in the queue at a "
                                "time (its feeder refills the window as they end); 0: this gateway feeds no "
                                "batches (another gateway or `mlxq batches feed` does)", minimum=0)
    batch_completion_window_s: int = setting("MLXQ_BATCH_COMPLETION_WINDOW", DEFAULT_COMPLETION_WINDOW_S,
                                             "seconds a batch's \"24h\" completion window lasts: after it, "
                                             "unfinished lines are batch_expired", minimum=1)
    client: ClientConfig = field(default_factory=ClientConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """The gateway's variables (see the fields) and its client's (:class:`~api.config.ClientConfig`); a bad
        value raises :class:`~api.errors.ConfigError` naming its variable."""
        env = os.environ if env is None else env
        client = ClientConfig.from_env(env)
        values = read(cls, env)
        values.setdefault("max_body_bytes", client.max_job_bytes)
        return cls(**values, client=client)
