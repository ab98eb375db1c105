"""The gateway's configuration, read once from the environment (prefix ``MLXQ_``) and passed down as one object;
each variable is declared once, on its field (``api/settings.py``)."""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..config import ClientConfig
from ..errors import ConfigError
from ..files import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_LINES
from ..files import DEFAULT_RETENTION_S as DEFAULT_FILE_RETENTION_S
from ..schema import MAX_TOKENS_CEILING, TENANT_PATTERN
from ..settings import read, setting

__all__ = ["GatewayConfig", "max_tokens_fields"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# The largest job workers read with their default limits (MLXQ_MAX_PAYLOAD_BYTES, and room for MLXQ_MAX_IMAGES
# images of MLXQ_MAX_IMAGE_BYTES each): a bigger body could not be queued. From the environment, the limits set.
DEFAULT_MAX_BODY_BYTES = ClientConfig().max_job_bytes
DEFAULT_RESPONSE_RETENTION_S = 30 * 86_400  # stored responses: OpenAI keeps them 30 days
# When a request names none (OpenAI's may not): no cap of the gateway's, as OpenAI's API serves it; the worker
# lowers it to what fits the context after the prompt, and to its MLXQ_MAX_TOKENS.
DEFAULT_MAX_TOKENS = MAX_TOKENS_CEILING

# Seconds before each delivery attempt of a webhook event (the first at once): 12 attempts over about 2 days
DEFAULT_WEBHOOK_SCHEDULE = (0.0, 5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 43200.0, 86400.0)
WEBHOOK_SECRET_PREFIX = "whsec_"
DEFAULT_BATCH_WINDOW = 256  # a batch's jobs in the queue at once: several workers' batches full
DEFAULT_COMPLETION_WINDOW_S = 86_400  # "24h"


def max_tokens_fields(named: int | None, cap: int = DEFAULT_MAX_TOKENS) -> dict[str, Any]:
    """A job's ``max_tokens`` fields from what its request named: that, or where it named none ``cap`` (no cap of
    ours by default), lowered by the worker to what fits the context after the prompt: OpenAI's rule, which the
    gateway and ``mlxq submit`` both follow."""
    return {"max_tokens": cap if named is None else named, "fit_max_tokens": named is None}


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


def _urls(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated http(s) URLs, each with a host."""
    urls = tuple(u.strip() for u in raw.split(",") if u.strip())
    for i, url in enumerate(urls, 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{name}: entry {i} ({url[:80]!r}) is not an http(s) URL with a host")
    return urls


def _secret(name: str, raw: str) -> str:
    """A Standard Webhooks secret: ``whsec_`` and the base64 of 24 to 64 random bytes."""
    raw = raw.strip()
    if not raw:
        return ""
    if not raw.startswith(WEBHOOK_SECRET_PREFIX):
        raise ConfigError(f"{name}: a webhook secret starts with {WEBHOOK_SECRET_PREFIX!r} (then base64 of 24 to 64 "
                          "random bytes: `python3 -c \"import base64,os; print('whsec_' + "
                          "base64.b64encode(os.urandom(32)).decode())\"`)")
    try:
        key = base64.b64decode(raw[len(WEBHOOK_SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{name}: what follows {WEBHOOK_SECRET_PREFIX!r} is not base64") from None
    if not 24 <= len(key) <= 64:
        raise ConfigError(f"{name}: the secret is {len(key)} bytes; a webhook secret is 24 to 64 bytes")
    return raw


def _schedule(name: str, raw: str) -> tuple[float, ...]:
    """Comma-separated seconds, each ≥ 0."""
    try:
        delays = tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{name}: comma-separated seconds, e.g. 0,5,30,120") from None
    if not delays or any(not 0 <= d < 1e9 for d in delays):
        raise ConfigError(f"{name}: comma-separated seconds ≥ 0, at least one")
    return delays


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
                                      "the context)", minimum=1,
                                      shown="unset: no cap (what fits the context, up to the workers' "
                                            "MLXQ_MAX_TOKENS)")
    response_retention_s: int = setting("MLXQ_RESPONSE_RETENTION", DEFAULT_RESPONSE_RETENTION_S, "seconds a stored "
                                        "response (/v1/responses, store true) is kept in Redis after its last "
                                        "write (OpenAI keeps them 30 days)", minimum=60)
    webhook_urls: tuple[str, ...] = setting("MLXQ_WEBHOOK_URL", (), "comma-separated http(s) endpoints every "
                                            "webhook event (a background response's end, a batch's) is POSTed to, "
                                            "signed per Standard Webhooks; unset: no webhooks", parse=_urls,
                                            shown="unset")
    webhook_secret: str = setting("MLXQ_WEBHOOK_SECRET", "", "the webhooks' signing secret, `whsec_` and base64 "
                                  "(24 to 64 bytes): the receiver's `client.webhooks.unwrap(..., secret=)`",
                                  parse=_secret, shown="unset (required with MLXQ_WEBHOOK_URL)")
    webhook_schedule: tuple[float, ...] = setting("MLXQ_WEBHOOK_SCHEDULE", DEFAULT_WEBHOOK_SCHEDULE, "seconds "
                                                  "before each delivery attempt of a webhook event, comma-separated "
                                                  "(a 429/503's Retry-After may push one later)", parse=_schedule,
                                                  shown="0,5,30,120,600,1800,3600,7200,14400,28800,43200,86400")
    webhook_timeout_s: float = setting("MLXQ_WEBHOOK_TIMEOUT", 15.0, "seconds one webhook POST may take",
                                       minimum=0.1)
    webhook_concurrency: int = setting("MLXQ_WEBHOOK_CONCURRENCY", 32, "webhook events one gateway delivers at "
                                       "once", minimum=1)
    webhook_claim_s: float = setting("MLXQ_WEBHOOK_CLAIM", 60.0, "seconds after which a webhook event a gateway "
                                     "took but stopped tending (it died) is taken by another", minimum=0.1)
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
    batch_no_worker_s: float = setting("MLXQ_BATCH_NO_WORKER_WAIT", 30.0, "seconds a batch's line waits for a "
                                       "live worker to serve its model (one restarting) before it is that line's "
                                       "model_not_found error", minimum=0)
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
        if values.get("webhook_urls") and not values.get("webhook_secret"):
            raise ConfigError("MLXQ_WEBHOOK_URL: webhooks are signed: set MLXQ_WEBHOOK_SECRET too (whsec_...)")
        return cls(**values, client=client)
