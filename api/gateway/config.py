"""The gateway's configuration, read once from the environment (prefix ``MLXQ_``) and passed down as one object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import ClientConfig

__all__ = ["GatewayConfig"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# The largest job workers read with their default limits (MLXQ_MAX_PAYLOAD_BYTES, and room for MLXQ_MAX_IMAGES
# images of MLXQ_MAX_IMAGE_BYTES each): a bigger body could not be queued. From the environment, the limits set.
DEFAULT_MAX_BODY_BYTES = ClientConfig().max_job_bytes
DEFAULT_MAX_TOKENS = 512  # when a request names none (OpenAI's may not): mlx_lm.server's default


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How the gateway listens, whom it serves and what it accepts; ``client`` is its queue client's."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    client: ClientConfig = field(default_factory=ClientConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        """``MLXQ_GATEWAY_HOST``, ``MLXQ_GATEWAY_PORT``, ``MLXQ_API_KEYS`` (comma-separated),
        ``MLXQ_GATEWAY_MAX_BODY`` (bytes; unset: the largest job the workers' limits let through, which the
        client's variables ``MLXQ_MAX_PAYLOAD_BYTES``, ``MLXQ_MAX_IMAGES`` and ``MLXQ_MAX_IMAGE_BYTES`` set, as
        on the workers), ``MLXQ_GATEWAY_MAX_TOKENS``, and the client's variables."""
        env = os.environ if env is None else env
        keys = frozenset(k.strip() for k in env.get("MLXQ_API_KEYS", "").split(",") if k.strip())
        client = ClientConfig.from_env(env)
        return cls(
            host=env.get("MLXQ_GATEWAY_HOST", DEFAULT_HOST),
            port=int(env.get("MLXQ_GATEWAY_PORT", DEFAULT_PORT)),
            api_keys=keys,
            max_body_bytes=int(env.get("MLXQ_GATEWAY_MAX_BODY", client.max_job_bytes)),
            default_max_tokens=int(env.get("MLXQ_GATEWAY_MAX_TOKENS", DEFAULT_MAX_TOKENS)),
            client=client,
        )
