"""Speculative decoding on a real worker: a draft model (MLXQ_DRAFT_MODEL) or prompt lookup (MLXQ_SPECULATE=ngram)
gives every job exactly the tokens and text of plain greedy decoding, the counters show what was proposed, and a
draft that cannot serve its target stops the worker at start-up with one line and exit 78."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent
from mlxq.api.status import _speculation
from mlxq.engine.core.prompt import encode_prompt
from tests.support import collect, config_with, reference, reference_text, start_worker, terminal, text_of

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a", "the quick brown fox jumps over the lazy dog " * 4, "Once upon a time", "1 2 3 4 5 6 7 8 9",
           "In the beginning the queue was empty " * 3, "x y"]
MAX_TOKENS = [24, 40, 16, 33, 20, 7]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from mlxq.worker.tools.tinymodel import ensure_model

    root = tmp_path_factory.mktemp("pair")
    return ensure_model("tiny-target", root=root), ensure_model("tiny-draft", root=root)


@pytest.fixture(scope="module")
def target_lm(pair: tuple[Path, Path]) -> Any:
    import mlx_lm

    return mlx_lm.load(str(pair[0]))


@pytest.mark.parametrize("mode", ["draft", "ngram"])
async def test_jobs_on_a_speculating_worker_equal_plain_greedy_decoding(mode: str, worker_config: Any,
                                                                        client: Client, pair: tuple[Path, Path],
                                                                        target_lm: Any) -> None:
    target, draft = pair
    config = config_with(worker_config, model=str(target), model_name="target",
                         draft_model=str(draft) if mode == "draft" else "", speculate=mode)
    running = await start_worker(config)
    try:
        rids = await asyncio.gather(*(client.submit(model="target", prompt=p, max_tokens=m)
                                      for p, m in zip(PROMPTS, MAX_TOKENS)))
        results = await asyncio.gather(*(collect(client, rid) for rid in rids))
        stats = running.service.engine.stats
        status = running.service.status(0.0)  # its part of the health record `mlxq status` shows
    finally:
        await running.close()
    for prompt, max_tokens, events in zip(PROMPTS, MAX_TOKENS, results):
        expected = reference(target_lm, encode_prompt(target_lm[1], prompt, None), max_tokens)
        assert isinstance(terminal(events), DoneEvent)
        assert [i for e in events if e.type == "token" for i in e.token_ids] == expected, prompt
        assert text_of(events) == reference_text(target_lm, expected)
        assert [e.seq for e in events] == list(range(len(events)))
    assert stats.spec_steps > 0 and stats.spec_drafted > 0  # the tuner tries every k before it settles
    assert status.speculation == mode and (status.drafted, status.accepted) == (stats.spec_drafted, stats.spec_accepted)
    assert _speculation(status).startswith(f"{mode} ") and " k=" in _speculation(status)


@pytest.mark.slow  # a fault or a whole program: out of the everyday run
def test_a_draft_that_cannot_serve_its_target_is_one_line_and_exit_78(pair: tuple[Path, Path], small_model: Path,
                                                                       tmp_path: Path, redis_url: str) -> None:
    other = small_model  # another vocabulary
    cases = [
        ({"MLXQ_DRAFT_MODEL": str(tmp_path / "none")}, f"mlxq worker: draft model of target: no model directory at "
                                                       f"{tmp_path / 'none'}"),
        ({"MLXQ_SPECULATE": "draft"}, "mlxq worker: MLXQ_SPECULATE=draft but target has no draft model"),
        ({"MLXQ_SPECULATE": "sometimes"}, "mlxq worker: MLXQ_SPECULATE='sometimes': expected draft, ngram or off"),
        ({"MLXQ_DRAFT_MODEL": str(other)}, f"worker cannot start: draft model {other} cannot draft for {pair[0]}: "
                                           "its vocabulary differs"),
    ]
    for setting, message in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
        env.update({"MLXQ_MODEL": str(pair[0]), "MLXQ_MODEL_NAME": "target", "MLXQ_REDIS_URL": redis_url}, **setting)
        proc = subprocess.run([sys.executable, "-m", "arq", "mlxq.worker.Settings"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 78, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert message in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_models_name_their_drafts_in_mlxq_models() -> None:
    from mlxq.worker.config import ServedModel, WorkerConfig

    config = WorkerConfig.from_env({"MLXQ_MODELS": "/m/big=big+/m/little,/m/other=other", "MLXQ_SPECULATE": "ngram"})
    assert config.served == (ServedModel("/m/big", "big", "/m/little"), ServedModel("/m/other", "other"))
    assert [config.speculation(s) for s in config.served] == ["draft", "ngram"]
    assert WorkerConfig.from_env({"MLXQ_MODEL": "/m/big"}).speculation(ServedModel("/m/big", "/m/big")) == ""
