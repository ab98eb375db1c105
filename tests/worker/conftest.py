"""Fixtures the worker tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aredis.Redis]:
    """A connection to the test's Redis (the scripts' tests call them directly)."""
    conn = aredis.Redis.from_url(redis_url)
    yield conn
    await conn.aclose()
