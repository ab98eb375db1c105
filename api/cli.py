"""The ``mlxq`` command: submit, cancel and follow jobs; serve the HTTP gateway; run the demo and the benchmark.

``submit`` writes exactly the generated text to stdout (so it pipes) and status to stderr. Producer
commands (``submit``, ``cancel``, ``events``) are the producer side's own and import no worker code, so a
producer-only install (``pip install mlxq``) has them; ``gateway`` needs the gateway extra (``api.gateway``),
and ``demo`` and ``bench`` are the worker's tools (``worker.tools``), each loaded only when asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .client import Client
from .errors import BadRequest, JobFailed, MlxqError
from .schema import ChatMessage, DoneEvent, ErrorEvent, GenerateRequest

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxq", description="MLX language models behind a Redis job queue.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="submit a job and stream its text to stdout")
    s.add_argument("prompt", help="raw prompt (tokenized like mlx_lm.generate), or a user message with --chat")
    s.add_argument("--model", required=True, help="model name, as the worker's MLXQ_MODEL or MLXQ_MODEL_NAME")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--chat", action="store_true", help="send PROMPT as one user message (chat template)")
    s.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    s.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job_id")

    e = sub.add_parser("events", help="print a job's events as JSON lines (replayed, then live)")
    e.add_argument("job_id")
    e.add_argument("--timeout", type=float, default=None)

    d = sub.add_parser("demo", help="embedded Redis + tiny model + worker + concurrent jobs, no setup")
    d.add_argument("--jobs", type=int, default=8, help="concurrent jobs in the batch phase")
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--size", choices=["tiny", "small"], default="tiny", help="generated model size")
    d.add_argument("--gateway", action="store_true",
                   help="then serve the HTTP gateway in front of the worker and print a curl line (until Ctrl-C)")
    d.add_argument("--port", type=int, default=8000, help="the gateway's port with --gateway (0: any free one)")

    g = sub.add_parser("gateway", help="OpenAI- and Anthropic-compatible HTTP API over the queue")
    g.add_argument("--host", default=None, help="address to listen on (default: MLXQ_GATEWAY_HOST or 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="port (default: MLXQ_GATEWAY_PORT or 8000)")
    g.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug logs one line per request")

    b = sub.add_parser("bench", help="raw mlx-lm vs the queue vs serial, side by side in one run")
    b.add_argument("--out", default="bench-out", help="directory for results.json, results.md, chart.png")
    b.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    b.add_argument("--sizes", default=None, help="comma-separated model sizes (default: tiny,small)")
    b.add_argument("--concurrency", default=None, help="comma-separated N values (default: 1,8,32)")
    b.add_argument("--max-tokens", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlxq`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            run_demo = _worker_tool("demo", "run_demo")
            return int(run_demo(jobs=args.jobs, max_tokens=args.max_tokens, size=args.size,
                                gateway_port=args.port if args.gateway else None))
        if args.command == "bench":
            return int(_worker_tool("bench", "run_bench")(args))
        if args.command == "gateway":
            return _gateway(args)
        return asyncio.run(_producer_command(args))
    except MlxqError as exc:  # Redis unreachable or refusing us, an unknown job: one line, no traceback
        print(f"mlxq: {exc}", file=sys.stderr)
        return 1
    except _MissingTool as exc:
        print(f"mlxq: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


class _MissingTool(Exception):
    pass


def _worker_tool(module: str, name: str) -> Callable[..., Any]:
    """A tool of the worker side, which a producer-only install lacks."""
    try:
        tool: Callable[..., Any] = getattr(importlib.import_module(f"worker.tools.{module}"), name)
    except ImportError as exc:
        raise _MissingTool(f"'{module}' needs the worker extra ({exc}): pip install 'mlxq[worker]'") from None
    return tool


_GATEWAY_NEEDS = frozenset({"starlette", "sse_starlette", "uvicorn", "anyio"})


def _gateway(args: argparse.Namespace) -> int:
    """``mlxq gateway``: needs the gateway extra, which a producer-only install lacks."""
    from dataclasses import replace

    try:
        from .gateway.config import GatewayConfig
        from .gateway.server import serve
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _GATEWAY_NEEDS:
            raise
        raise _MissingTool(f"'gateway' needs the gateway extra ({exc}): pip install 'mlxq[gateway]'") from None
    config = GatewayConfig.from_env()
    config = replace(config, host=args.host or config.host, port=args.port or config.port)
    return serve(config, workers=args.workers, log_level=args.log_level)


async def _producer_command(args: argparse.Namespace) -> int:
    async with Client() as client:
        if args.command == "cancel":
            await client.cancel(args.job_id)
            print(f"cancel requested for {args.job_id}", file=sys.stderr)
            return 0
        if args.command == "events":
            async for ev in client.events(args.job_id, timeout=args.timeout):
                print(ev.model_dump_json(), flush=True)
            return 0
        return await _submit(client, args)


async def _submit(client: Client, args: argparse.Namespace) -> int:
    try:
        req = GenerateRequest(
            model=args.model,
            prompt=None if args.chat else args.prompt,
            messages=[ChatMessage(role="user", content=args.prompt)] if args.chat else None,
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            seed=args.seed, stop=args.stop,
        )
    except ValueError as exc:
        print(f"mlxq: bad request: {exc}", file=sys.stderr)
        return 2
    try:
        rid = await client.submit(req)
    except BadRequest as exc:
        print(f"mlxq: bad request: {exc}", file=sys.stderr)
        return 2
    if args.no_wait:
        print(rid)
        return 0
    print(f"job {rid} queued on {client.keys.queue(req.model)}", file=sys.stderr)
    return await _stream(client, rid, args.timeout)


async def _stream(client: Client, rid: str, timeout: float | None) -> int:
    out = sys.stdout
    try:
        async for ev in client.events(rid, timeout=timeout):
            if ev.type == "token":
                out.write(ev.text)
                out.flush()
            elif ev.type == "reset":
                print(f"\n[job restarted (attempt {ev.attempt}): {ev.reason}]", file=sys.stderr)
            elif isinstance(ev, DoneEvent):
                t = ev.timings
                tps = f"{t.tokens_per_s:.1f} tok/s" if t.tokens_per_s else "-"
                ttft = f"{t.ttft_ms:.0f} ms" if t.ttft_ms is not None else "-"
                print(f"\n[{ev.finish_reason.value}: {ev.usage.completion_tokens} tokens, ttft {ttft}, "
                      f"{tps}, total {t.total_ms:.0f} ms]", file=sys.stderr)
            elif isinstance(ev, ErrorEvent):
                raise JobFailed(ev)
    except MlxqError as exc:
        print(f"\nmlxq: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
