"""The prefix cache on disk through real workers: a conversation's next turn, after its worker was restarted (in
this process; and, slow, a worker process stopped by SIGTERM or killed by SIGKILL between the turns), starts
from its prefix on disk (the disk hit counters of the engine, of /metrics and of the health record say so) with
mlx-lm's greedy tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.status import collect, render
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.worker.tools.process import WorkerProcess
from tests.support import config_with, free_port, reference, start_worker, wait_for
from tests.worker.test_worker_metrics import scrape, value

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You answer for a job queue that keeps its caches on disk. " * 6}
FIRST = [SYSTEM, {"role": "user", "content": "What survives a restart?"}]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


def second(answer: str) -> list[dict[str, str]]:
    return [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "And what does not?"}]


def tokens_of(lm: Any, messages: list[dict[str, str]]) -> list[int]:
    return encode_prompt_with_boundary(lm[1], None, messages).tokens


async def test_a_restarted_worker_starts_the_next_turn_from_disk(worker_config: Any, client: Client, lm: Any,
                                                                 tmp_path: Path) -> None:
    config = config_with(worker_config, kv_dir=str(tmp_path), kv_disk_gb=1.0)
    running = await start_worker(config)
    try:
        first = await client.generate(model="tiny", messages=FIRST, max_tokens=MAX_TOKENS, timeout=60)
        assert running.service.engine.stats.prefix_disk_hits == 0
    finally:
        await running.close()
    assert list(tmp_path.rglob("*.kv.safetensors"))  # written, and kept at the stop
    port = free_port()
    running = await start_worker(config_with(config, metrics_port=port, metrics_addr="127.0.0.1"))
    try:
        messages = second(first.text)
        result = await client.generate(model="tiny", messages=messages, max_tokens=MAX_TOKENS, timeout=60)
        stats = running.service.engine.stats
        assert stats.prefix_disk_hits == 1 and stats.prefix_hits == 1 and stats.prefix_disk_errors == 0
        assert stats.prefix_tokens_saved >= len(tokens_of(lm, FIRST)) - 1
        disk = running.service.engine.scheduler.prefix_cache.disk
        assert await asyncio.to_thread(disk.flush)  # turn 2's entries written, with the engine idle since
        samples = await asyncio.to_thread(scrape, port)
        assert value(samples, "mlxq:prefix_disk_hits_total", model_name="tiny") == 1
        assert value(samples, "mlxq:prefix_disk_entries", model_name="tiny") >= 1
        assert value(samples, "mlxq:prefix_disk_bytes", model_name="tiny") > 0
        await running.host.health.beat()  # the health record (mlxq status, the dashboard) counts the same
        (record,) = (await client.workers())[0].models
        assert (record.prefix_disk_hits, record.prefix_disk_errors, record.prefix_hits) == (1, 0, 1)
        assert record.prefix_disk_entries == value(samples, "mlxq:prefix_disk_entries", model_name="tiny") >= 1
        assert record.prefix_disk_bytes == value(samples, "mlxq:prefix_disk_bytes", model_name="tiny") > 0
        # the tier's counts as of now, though the engine has not stepped since the writes
        assert record.prefix_disk_writes == value(samples, "mlxq:prefix_disk_writes_total", model_name="tiny") >= 1
        assert record.prefix_disk_dropped == value(samples, "mlxq:prefix_disk_dropped_total", model_name="tiny")
        assert "disk 1 hits" in render(await collect(client))
    finally:
        await running.close()
    assert result.token_ids == reference(lm, tokens_of(lm, messages), MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_a_worker_process_restarted_between_two_turns_starts_the_second_from_disk(
        redis_url: str, tiny_model: Path, tmp_path: Path, client: Client, lm: Any, how: str) -> None:
    kv_dir = tmp_path / "kv"

    def start(name: str, port: int = 0) -> WorkerProcess:
        env = {"MLXQ_MODEL": str(tiny_model), "MLXQ_MODEL_NAME": "tiny", "MLXQ_REDIS_URL": redis_url,
               "MLXQ_KV_DIR": str(kv_dir), "MLXQ_KV_DISK_GB": "1", "MLXQ_METRICS_PORT": str(port),
               "MLXQ_METRICS_ADDR": "127.0.0.1", "MLXQ_LEASE_TTL": "2", "MLXQ_REAP_INTERVAL": "0.5"}
        proc = WorkerProcess(env, tmp_path / f"{name}.log").start()
        proc.wait_ready(timeout=120)
        return proc

    first_worker = start("first")
    try:
        first = await client.generate(model="tiny", messages=FIRST, max_tokens=MAX_TOKENS, timeout=60)
        if how == "sigterm":
            assert await asyncio.to_thread(first_worker.stop, 60) == 0  # SIGTERM: a graceful stop
        else:  # written as it was cached, before any stop: a killed worker leaves it too
            await wait_for(lambda: bool(list(kv_dir.rglob("*.kv.safetensors"))), "the entry on disk", timeout=30)
            first_worker.kill()
    finally:
        first_worker.kill()
    port = free_port()
    second_worker = start("second", port)
    try:
        messages = second(first.text)
        result = await client.generate(model="tiny", messages=messages, max_tokens=MAX_TOKENS, timeout=60)
        samples = await asyncio.to_thread(scrape, port)
        assert value(samples, "mlxq:prefix_disk_hits_total", model_name="tiny") == 1
        assert value(samples, "mlxq:prefix_disk_errors_total", model_name="tiny") == 0
        assert value(samples, "mlxq:prefix_cache_hits_total", model_name="tiny") == 1
    finally:
        second_worker.kill()
    assert result.token_ids == reference(lm, tokens_of(lm, messages), MAX_TOKENS)


def test_the_health_record_reads_each_of_its_counters_from_the_engines() -> None:
    from mlxq.api.schema import ModelStatus
    from mlxq.engine.core.stats import EngineStats
    from mlxq.worker.service import _RECORD_STATS

    disk = {f for f in EngineStats.__dataclass_fields__ if f.startswith("prefix_disk_")}
    assert disk <= {stat for _, stat in _RECORD_STATS}  # every counter of the tier on disk is in the record
    for field, stat in _RECORD_STATS:
        assert field in ModelStatus.model_fields and stat in EngineStats.__dataclass_fields__
