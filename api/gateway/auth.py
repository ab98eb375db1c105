"""Optional bearer-token authentication: ``MLXQ_API_KEYS`` lists the keys a request may present.

OpenAI clients send ``Authorization: Bearer <key>``; Anthropic's send ``x-api-key: <key>``. Either is accepted
on every route but ``/health`` (load balancers probe it without a key). An entry ``<key>=<tenant>`` names whose
jobs that key's requests are (``GenerateRequest.tenant``); a key without a name, or no keys at all, the default
tenant. Nothing a caller sends (the OpenAI ``user`` field, a header) chooses the tenant.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

from ..schema import DEFAULT_TENANT, TENANT_PATTERN
from .errors import GatewayError, Kind, Problem

__all__ = ["Auth"]


class Auth:
    """Checks a request's key against the configured ones (none configured: every request passes)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = [(k.encode(), t) for k, t in sorted(map(key_tenant, keys))]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Mapping[str, str]) -> str:
        """The tenant of the key the headers carry; a 401 :class:`GatewayError` unless they carry a configured
        key (none configured: every request passes, as the default tenant)."""
        if not self._keys:
            return DEFAULT_TENANT
        presented = _presented(headers)
        if presented is None:
            raise GatewayError(Problem(Kind.UNAUTHORIZED, "missing API key: send 'Authorization: Bearer <key>' "
                                       "or 'x-api-key: <key>'", "missing_api_key"))
        # Compare against every key, in constant time each: the time taken says nothing about which matched.
        tenant = None
        for key, name in self._keys:
            if hmac.compare_digest(presented, key):
                tenant = name
        if tenant is None:
            raise GatewayError(Problem(Kind.UNAUTHORIZED, "invalid API key", "invalid_api_key"))
        return tenant


def key_tenant(entry: str) -> tuple[str, str]:
    """An ``MLXQ_API_KEYS`` entry as (key, tenant): ``key=name`` names one when ``name`` is a tenant name
    (a key of base64 padding, ``abc==``, names none)."""
    key, sep, name = entry.rpartition("=")
    if sep and key and re.match(TENANT_PATTERN, name):
        return key, name
    return entry, DEFAULT_TENANT


def _presented(headers: Mapping[str, str]) -> bytes | None:
    bearer = headers.get("authorization", "")
    scheme, _, token = bearer.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    key = headers.get("x-api-key", "").strip()
    return key.encode() if key else None
