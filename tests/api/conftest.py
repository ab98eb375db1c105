"""The official SDKs as clients of a module's gateway: each gateway test module defines ``served`` (a deployment
and its gateway), and these fixtures point the SDKs at it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import pytest

from tests.api.gateway_support import Deployment, ServedGateway


@pytest.fixture
async def oai(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def claude(served: tuple[Deployment, ServedGateway]) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=served[1].url, api_key="unused", max_retries=0) as c:
        yield c
