"""A worker whose engines run no model: ``python -m arq tests.perf.simworker.Settings`` is the real worker process
(claims, lifecycle, leases, the pacer, the run table and all their Redis traffic) whose models are simulated, for
the control plane's benchmark (``scale.py``).

A simulated model is a directory whose config.json has ``"model_type": "mlxq-sim"`` and ``tokens_per_s``
(:func:`make_model`). Its engine is the real :class:`~mlxq.engine.core.engine.Engine` and scheduler over a batch
that makes one token per row every ``1 / tokens_per_s`` seconds (every row steps on the same tick, as a real
batch does) and computes nothing; each token's text is the wall-clock time it came out of the batch (``"%.6f "``),
so a subscriber reading the text knows how long delivery took (the processes share the machine's clock).

Nothing of this is on a production path: the bench starts the worker with this module as its settings, which
swaps ``start_engine`` before the worker's own settings are built.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlxq.engine.core.backend import BatchToken
from mlxq.engine.core.engine import Engine, Sink
from mlxq.engine.core.prompt import PromptEncoder
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.loader import EngineOptions, LoadedModel
from mlxq.engine.mlx.thread import MLXThread

__all__ = ["SIM_TYPE", "SimBatch", "Stamps", "make_model", "start_sim_engine"]

SIM_TYPE = "mlxq-sim"
_EOS = 0
_CONTEXT = 1 << 20


def make_model(directory: Path, tokens_per_s: float) -> Path:
    """A simulated model's directory (what ``MLXQ_MODEL`` names) making ``tokens_per_s`` tokens a second a row."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": SIM_TYPE, "tokens_per_s": tokens_per_s}))
    return directory


class Stamps:
    """The detokenizer: each token's text is the time it was added (seconds since the epoch, then a space)."""

    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = f"{time.time():.6f} "

    def finalize(self) -> None:
        self.last_segment = ""


class _Tokenizer:
    """Just what the worker asks of a tokenizer for a raw prompt: one token per byte (never the EOS id)."""

    bos_token = None
    eos_token_ids = [_EOS]
    has_thinking = False
    has_tool_calling = False
    tool_parser = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b or 1 for b in text.encode()] or [1]

    def decode(self, tokens: list[int]) -> str:
        return "x" * len(tokens)

    @property
    def detokenizer(self) -> Stamps:
        return Stamps()


class SimBatch:
    """A continuous batch that steps every ``1 / tokens_per_s`` seconds: each step sleeps until the next tick, then
    gives every row a token (rows end at their max_tokens)."""

    def __init__(self, tokens_per_s: float) -> None:
        self.period = 1.0 / tokens_per_s
        self.rows: dict[int, int] = {}  # uid -> tokens left
        self._next_uid = 0
        self._tick = time.monotonic()

    def insert(self, prompt: list[int], max_tokens: int, sampler: Any, logits_processors: list[Any], *,
               images: Any = None) -> int:
        if not prompt:
            raise ValueError("empty prompt")  # as mlx-lm
        self._next_uid += 1
        self.rows[self._next_uid] = max_tokens
        return self._next_uid

    def remove(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self.rows.pop(uid, None)

    def step(self) -> list[BatchToken]:
        now = time.monotonic()
        self._tick = max(self._tick + self.period, now)  # a late step does not make up for lost ticks
        time.sleep(self._tick - now)
        out = []
        for uid, left in list(self.rows.items()):
            if left <= 1:
                del self.rows[uid]
                out.append(BatchToken(uid, 7, "length"))
            else:
                self.rows[uid] = left - 1
                out.append(BatchToken(uid, 7, None))
        return out

    def attach_logprobs(self, asked: list[Any]) -> None:
        raise NotImplementedError("simulated models give no log-probabilities")

    def close(self) -> None:
        self.rows.clear()


async def start_sim_engine(path: str, sink: Sink, options: EngineOptions | None = None
                           ) -> tuple[Engine, LoadedModel]:
    """``engine.loader.start_engine`` for a simulated model: the real engine and scheduler over a :class:`SimBatch`
    (on an MLX thread, as the real one, though it runs no MLX)."""
    opts = options or EngineOptions()
    config = json.loads((Path(path) / "config.json").read_text())
    if config.get("model_type") != SIM_TYPE:
        raise ValueError(f"{path} is not a simulated model (model_type {SIM_TYPE!r})")
    rate = float(config["tokens_per_s"])
    tokenizer = _Tokenizer()
    loaded = LoadedModel(path, None, tokenizer, _CONTEXT, frozenset({_EOS}), PromptEncoder(tokenizer))
    thread = MLXThread(name="sim-" + Path(path).name)

    def make_backend() -> SimBatch:
        return SimBatch(rate)

    scheduler = Scheduler(make_backend(), capacity=opts.capacity, new_detokenizer=Stamps, context_length=_CONTEXT)
    engine = Engine(thread, scheduler, sink, make_backend=make_backend, stream_interval_s=opts.stream_interval_s,
                    prefill_batch=opts.prefill_batch_size, stream_rate=opts.stream_rate)
    return engine, loaded


def __getattr__(name: str) -> Any:
    # ``arq tests.perf.simworker.Settings``: the worker's own settings, its engines simulated.
    if name == "Settings":
        from mlxq.worker import service, settings

        service.start_engine = start_sim_engine  # type: ignore[assignment]
        return settings.Settings
    raise AttributeError(name)
