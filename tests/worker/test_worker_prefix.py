"""Through Redis and a real arq worker: chat jobs sharing a system prompt reuse its KV cache (the worker
passes the chat template's system-prompt boundary with the tokens), with mlx-lm's greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from tests.support import RunningWorker, reference

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are the model behind a Redis job queue; answer in few tokens. " * 6}


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


async def test_chat_jobs_sharing_a_system_prompt_reuse_its_cache(worker: RunningWorker, client: Client,
                                                                  lm: Any) -> None:
    engine = worker.service.engine
    for i, question in enumerate(("What is a queue?", "And a worker?")):
        messages = [SYSTEM, {"role": "user", "content": question}]
        result = await client.generate(model="tiny", messages=messages, max_tokens=10, timeout=60)
        prompt = encode_prompt_with_boundary(lm[1], None, messages)
        assert result.token_ids == reference(lm, prompt.tokens, 10)
        if i == 0:
            assert engine.stats.prefix_hits == 0 and engine.stats.prefix_cache_entries >= 1
    assert engine.stats.prefix_hits == 1
    assert engine.stats.prefix_tokens_saved >= prompt.cache_boundary > 0
    totals = worker.host.metrics.totals()  # what /metrics and the stats line show
    assert totals["prefix_cache_hits"] == 1 and totals["prefix_cache_queries"] == 2
    assert totals["prefix_cache_tokens_saved"] == engine.stats.prefix_tokens_saved
    line = worker.host.stats_line()
    assert "prefix_cache_hits=1 " in line and f"prefix_cache_bytes={engine.stats.prefix_cache_bytes:g}" in line
    assert engine.stats.prefix_cache_bytes > 0
