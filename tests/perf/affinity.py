"""Prefix affinity against issue 38's targets, on two worker processes serving one generated model through an
embedded Redis:

Eight conversations, each with its own long system prompt (``system_tokens``), run their turns at once, each turn
after a random pause (exponential, mean ``think_s``, the same seeded draws for every setup), each next turn the
last one's messages plus its answer and a new question. Three setups, fresh workers each:

- **affinity**: as deployed (the prefix cache on, ``MLXQ_AFFINITY_WAIT_MS`` at its default);
- **no affinity**: the prefix cache on, but every turn a ``prompt_cache_key`` of its own (no worker ever holds
  one): a turn starts on whichever worker claims first, as before affinity;
- **cache off**: ``MLXQ_PREFIX_CACHE_GB=0`` (and the disk tier off, as in every setup).

Measured: the share of turns after each conversation's first that start on a worker that ran one of its earlier
turns (which holds its prefix; target ≥ 90 %), the fleet's TTFT p50 (enqueue → first token) of every turn, against
the cache off (target ≥ 8x), and each worker's share of the turns (target: neither below 0.8 of the other's); and
the workers' own affinity counters (``mlxq status``'s, from their health records).

``--shape system`` (issue 52): the deployment with long system prompts and single-turn requests (RAG,
classification, agents): six conversations, each its own system prompt, each turn that system message and one new
question (no history); the first turns at once, then the later turns one at a time. A later turn shares only the
system prompt with its conversation's earlier turns: the share measured is of later turns starting on a worker that
ran one of them (and so holds the system prompt), with the same target.

``python3 -m tests.perf.affinity --out DIR`` writes ``affinity.md`` and ``affinity.json`` (``affinity-system.*``
for ``--shape system``; ``--setups``: some of the three; ``--quick``: the tiny model, shorter prompts, fewer turns;
``--size``, ``--system-tokens``, ``--turns`` change one of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent, ErrorEvent, StartEvent, TokenEvent
from mlxq.worker.tools.bench.runs import say
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

__all__ = ["main"]

_HOLDER_TARGET = 0.90
_TTFT_TARGET = 8.0
_BALANCE_TARGET = 0.8
SYSTEM_SHAPE_TOKENS = 360  # the system shape's shortest system prompts (Plan.shaped)
_WORDS = ("queue", "model", "token", "server", "batch", "cache", "prompt", "worker", "stream", "reply", "prefix",
          "lease", "tenant", "redis", "engine", "memory")


@dataclass(frozen=True, slots=True)
class Plan:
    """How much the run does (``quick``: a smoke run)."""

    size: str = "small"
    conversations: int = 8
    turns: int = 5
    system_tokens: int = 1500
    max_tokens: int = 16
    think_s: float = 1.0
    seed: int = 38
    shape: str = "chat"  # "chat": conversations with history; "system": single-turn requests (module docstring)

    @classmethod
    def quick(cls) -> Plan:
        return cls(size="tiny", turns=3, system_tokens=300, max_tokens=8, think_s=0.3)

    def shaped(self, shape: str) -> Plan:
        """This plan for ``shape``: the system shape runs six conversations of four turns (18 later turns), with
        system prompts of at least ``SYSTEM_SHAPE_TOKENS`` (the quick plan's 300 tokens of the tiny model's
        tokenizer, ~1.6 characters a token, fall around api/affinity.py's SYSTEM_CHARS: some would get no key)."""
        if shape == "chat":
            return self
        return replace(self, shape=shape, conversations=6, turns=4,
                       system_tokens=max(self.system_tokens, SYSTEM_SHAPE_TOKENS))


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    turn: int
    worker: str
    ttft_ms: float
    prompt_tokens: int


@dataclass(slots=True)
class Setup:
    name: str
    turns: list[Turn] = field(default_factory=list)
    placed: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> its affinity counters
    wall_s: float = 0.0

    @property
    def on_holder(self) -> float:
        """Turns after the first that started on a worker that ran an earlier turn of their conversation."""
        ran: dict[int, set[str]] = {}
        hits = later = 0
        for t in sorted(self.turns, key=lambda t: (t.conversation, t.turn)):
            seen = ran.setdefault(t.conversation, set())
            if t.turn > 0:
                later += 1
                hits += t.worker in seen
            seen.add(t.worker)
        return hits / max(1, later)

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(t.ttft_ms for t in self.turns)

    @property
    def later_ttft_p50_ms(self) -> float:
        return statistics.median(t.ttft_ms for t in self.turns if t.turn > 0)

    @property
    def balance(self) -> float:
        """The fewer turns a worker ran ÷ the more (1: even)."""
        counts = Counter(t.worker for t in self.turns)
        if len(counts) < 2:
            return 0.0
        low, high = min(counts.values()), max(counts.values())
        return low / high


def _system_prompt(i: int, tokens: int, tokenizer: Any) -> str:
    """Conversation ``i``'s system prompt, about ``tokens`` tokens, its words in an order of its own."""
    rng = random.Random(1000 + i)
    words = [f"Conversation {i}."] + [rng.choice(_WORDS) for _ in range(tokens)]
    n = len(words)
    while n > 1 and len(tokenizer.encode(" ".join(words[:n]))) > tokens:
        n = n * 19 // 20
    return " ".join(words[:n])


class _Fleet:
    """An embedded Redis's two worker processes on one generated model, under a prefix of their own."""

    def __init__(self, server: RedisServer, model: str, out: Path, name: str, env: dict[str, str]) -> None:
        self.server, self.prefix = server, f"mlxq-bench-affinity-{uuid.uuid4().hex[:6]}"
        base = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": server.url, "MLXQ_PREFIX": self.prefix,
                "MLXQ_KV_DISK_GB": "0", "MLXQ_JOB_EXPIRY": "0", "OPENBLAS_NUM_THREADS": "1", **env}
        self.workers = [WorkerProcess(base, out / "logs" / f"worker-affinity-{name}-{k}.log").start() for k in (1, 2)]
        for w in self.workers:
            w.wait_ready(timeout=300)

    def client(self) -> Client:
        return Client(self.server.url, prefix=self.prefix, retry_deadline=30)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


@dataclass(frozen=True, slots=True)
class TurnOut:
    """One chat job followed to its end."""

    worker: str
    text: str
    ttft_ms: float  # the worker's: enqueue to the first token published
    client_ttft_ms: float  # submit to the first token event, at the client
    prompt_tokens: int


async def turn(c: Client, messages: list[dict[str, str]], max_tokens: int, key: str | None = None) -> TurnOut:
    """Submit one chat job (greedy) and follow it to its end; a failed job raises."""
    t0 = time.perf_counter()
    rid = await c.submit(model="m", messages=messages, max_tokens=max_tokens, prompt_cache_key=key)
    worker, text, first = "", [], 0.0
    async for ev in c.events(rid, timeout=900):
        if isinstance(ev, StartEvent):
            worker = ev.worker
        elif isinstance(ev, TokenEvent):
            first = first or (time.perf_counter() - t0) * 1000
            text.append(ev.text)
        elif isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {rid} failed: {ev.code.value}: {ev.message}")
        elif isinstance(ev, DoneEvent):
            return TurnOut(worker, "".join(text), ev.timings.ttft_ms or 0.0, first, ev.usage.prompt_tokens)
    raise RuntimeError(f"job {rid}: no end")


async def _conversation(c: Client, i: int, system: str, plan: Plan, own_keys: bool, setup: Setup) -> None:
    rng = random.Random(plan.seed * 100 + i)
    messages = [{"role": "system", "content": system}]
    for k in range(plan.turns):
        await asyncio.sleep(rng.expovariate(1 / plan.think_s))
        messages.append(_question(i, k))
        key = uuid.uuid4().hex if own_keys else None
        out = await turn(c, messages, plan.max_tokens, key)
        worker, answer, ttft, prompt = out.worker, out.text, out.ttft_ms, out.prompt_tokens
        setup.turns.append(Turn(i, k, worker, ttft, prompt))
        messages.append({"role": "assistant", "content": answer})


def _question(i: int, k: int) -> dict[str, str]:
    return {"role": "user", "content": f"Question {k} of conversation {i}: what is a {_WORDS[(i + k) % len(_WORDS)]}?"}


async def _single(c: Client, i: int, k: int, system: str, plan: Plan, own_keys: bool, setup: Setup) -> None:
    """Turn ``k`` of conversation ``i`` in the system shape: its system message and one new question."""
    messages = [{"role": "system", "content": system}, _question(i, k)]
    out = await turn(c, messages, plan.max_tokens, uuid.uuid4().hex if own_keys else None)
    setup.turns.append(Turn(i, k, out.worker, out.ttft_ms, out.prompt_tokens))


async def _single_turns(c: Client, systems: list[str], plan: Plan, own_keys: bool, setup: Setup) -> None:
    """The system shape: every conversation's first turn at once, then the later turns one at a time."""
    await asyncio.gather(*(_single(c, i, 0, s, plan, own_keys, setup) for i, s in enumerate(systems)))
    for k in range(1, plan.turns):
        for i, s in enumerate(systems):
            await _single(c, i, k, s, plan, own_keys, setup)


async def _run_setup(fleet: _Fleet, name: str, systems: list[str], plan: Plan, own_keys: bool) -> Setup:
    setup = Setup(name)
    async with fleet.client() as c:
        t0 = time.monotonic()
        if plan.shape == "system":
            await _single_turns(c, systems, plan, own_keys, setup)
        else:
            await asyncio.gather(*(_conversation(c, i, s, plan, own_keys, setup) for i, s in enumerate(systems)))
        setup.wall_s = time.monotonic() - t0
        await asyncio.sleep(2.5)  # a heartbeat: the health records carry the last counters
        for w in await c.workers():
            (m,) = w.models
            setup.placed[w.id] = {"holder": m.affinity_holder, "elsewhere": m.affinity_elsewhere,
                                  "none": m.affinity_none, "keys": m.affinity_keys, "prefix_hits": m.prefix_hits,
                                  "prefix_misses": m.prefix_misses}
    return setup


SETUPS: tuple[tuple[str, dict[str, str], bool], ...] = (  # name, the workers' settings, a key of its own per turn
    ("affinity", {}, False), ("no affinity", {}, True), ("cache off", {"MLXQ_PREFIX_CACHE_GB": "0"}, False))


_NAMES = tuple(setup[0] for setup in SETUPS)


def run(plan: Plan, out: Path, names: tuple[str, ...] = _NAMES) -> list[Setup]:
    from transformers import AutoTokenizer

    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(plan.size))
    tokenizer = AutoTokenizer.from_pretrained(model)
    systems = [_system_prompt(i, plan.system_tokens, tokenizer) for i in range(plan.conversations)]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    setups = []
    with RedisServer() as server:
        for name, env, own_keys in (s for s in SETUPS if s[0] in names):
            fleet = _Fleet(server, model, out, name.replace(" ", "-"), env)
            try:
                setup = asyncio.run(_run_setup(fleet, name, systems, plan, own_keys))
            finally:
                fleet.stop()
            setups.append(setup)
            say(f"[affinity] {name}: {setup.on_holder:.0%} of later turns on a holder, TTFT p50 "
                f"{setup.ttft_p50_ms:.0f} ms (later turns {setup.later_ttft_p50_ms:.0f} ms), balance "
                f"{setup.balance:.2f}, {setup.wall_s:.0f} s")
    return setups


def markdown(plan: Plan, setups: list[Setup]) -> str:
    by = {s.name: s for s in setups}
    aff, off = by["affinity"], by["cache off"]
    speedup = off.ttft_p50_ms / max(1e-3, aff.ttft_p50_ms)
    other = f" (no affinity: {by['no affinity'].on_holder:.1%})" if "no affinity" in by else ""
    rows = [f"| later turns starting on a worker holding their prefix | {aff.on_holder:.1%}{other} | "
            f"≥ {_HOLDER_TARGET:.0%} | "
            f"{'PASS' if aff.on_holder >= _HOLDER_TARGET else 'MISS'} |",
            f"| fleet TTFT p50, cache off ÷ affinity ({off.ttft_p50_ms:.0f} ms ÷ {aff.ttft_p50_ms:.0f} ms) | "
            f"{speedup:.1f}x | ≥ {_TTFT_TARGET:g}x | {'PASS' if speedup >= _TTFT_TARGET else 'MISS'} |",
            f"| turns of the less busy worker ÷ the busier | {aff.balance:.2f} | ≥ {_BALANCE_TARGET} | "
            f"{'PASS' if aff.balance >= _BALANCE_TARGET else 'MISS'} |"]
    detail = ["| setup | later turns on a holder | TTFT p50 (all) | TTFT p50 (later turns) | balance | wall |",
              "|---|---:|---:|---:|---:|---:|"]
    for s in setups:
        detail.append(f"| {s.name} | {s.on_holder:.1%} | {s.ttft_p50_ms:.0f} ms | {s.later_ttft_p50_ms:.0f} ms | "
                      f"{s.balance:.2f} | {s.wall_s:.0f} s |")
    counters = ["| setup | worker | holder | elsewhere | none | keys | prefix hits / misses |", "|---|---|---:|---:|"
                "---:|---:|---|"]
    for s in setups:
        for w, c in sorted(s.placed.items()):
            counters.append(f"| {s.name} | {w} | {c['holder']} | {c['elsewhere']} | {c['none']} | {c['keys']} | "
                            f"{c['prefix_hits']} / {c['prefix_misses']} |")
    if plan.shape == "system":
        head = (f"# Prefix affinity, single-turn requests sharing a system prompt ({plan.size} model, two workers, "
                f"{plan.conversations} conversations x {plan.turns} turns, each its ~{plan.system_tokens}-token "
                f"system prompt and one new question, {plan.max_tokens} tokens a turn; the first turns at once, "
                "the later ones one at a time)")
    else:
        head = (f"# Prefix affinity ({plan.size} model, two workers, {plan.conversations} conversations x "
                f"{plan.turns} turns, ~{plan.system_tokens}-token system prompts, {plan.max_tokens} tokens a turn, "
                f"pauses of {plan.think_s:g} s on average)")
    return "\n".join([head, "", "| target | value | limit | |", "|---|---:|---:|---|", *rows, "", *detail, "",
                      "Each worker's affinity counters (health record) and prefix cache:", "", *counters, ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.affinity", description=__doc__)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", help="the generated model (default small; --quick: tiny, whose context is 512)")
    ap.add_argument("--system-tokens", type=int, help="each conversation's system prompt (default 1500)")
    ap.add_argument("--turns", type=int, help="turns per conversation (default 5; the system shape: 4)")
    ap.add_argument("--shape", choices=("chat", "system"), default="chat",
                    help="conversations with history (default), or single-turn requests sharing system prompts")
    ap.add_argument("--setups", default=",".join(_NAMES),
                    help="which setups to run, comma-separated (default all; affinity and cache off are needed)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = (Plan.quick() if args.quick else Plan()).shaped(args.shape)
    changes = {"size": args.size, "system_tokens": args.system_tokens, "turns": args.turns}
    plan = replace(plan, **{k: v for k, v in changes.items() if v is not None})
    names = tuple(n.strip() for n in args.setups.split(","))
    if not {"affinity", "cache off"} <= set(names) or not set(names) <= set(_NAMES):
        ap.error(f"--setups: 'affinity' and 'cache off' are needed, of {list(_NAMES)}")
    setups = run(plan, out, names)
    text = markdown(plan, setups)
    name = "affinity" if plan.shape == "chat" else f"affinity-{plan.shape}"
    (out / f"{name}.md").write_text(text)
    data: dict[str, Any] = {"plan": asdict(plan), "setups": [
        {**asdict(s), "on_holder": s.on_holder, "ttft_p50_ms": s.ttft_p50_ms, "later_ttft_p50_ms": s.later_ttft_p50_ms,
         "balance": s.balance} for s in setups]}
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
