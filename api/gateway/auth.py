"""Optional bearer-token authentication: ``MLXQ_API_KEYS`` lists the keys a request may present.

OpenAI clients send ``Authorization: Bearer <key>``; Anthropic's send ``x-api-key: <key>``. Either is accepted
on every route but ``/health`` (load balancers probe it without a key).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from .errors import GatewayError, Kind, Problem

__all__ = ["Auth"]


class Auth:
    """Checks a request's key against the configured ones (none configured: every request passes)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = [k.encode() for k in sorted(keys)]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Mapping[str, str]) -> None:
        """Raise a 401 :class:`GatewayError` unless the headers carry a configured key."""
        if not self._keys:
            return
        presented = _presented(headers)
        if presented is None:
            raise GatewayError(Problem(Kind.UNAUTHORIZED, "missing API key: send 'Authorization: Bearer <key>' "
                                       "or 'x-api-key: <key>'", "missing_api_key"))
        # Compare against every key, in constant time each: the time taken says nothing about which matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise GatewayError(Problem(Kind.UNAUTHORIZED, "invalid API key", "invalid_api_key"))


def _presented(headers: Mapping[str, str]) -> bytes | None:
    bearer = headers.get("authorization", "")
    scheme, _, token = bearer.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    key = headers.get("x-api-key", "").strip()
    return key.encode() if key else None
