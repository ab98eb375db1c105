"""``mlxq demo``, ``gateway``, ``dashboard`` and ``bench``: the commands that need an extra. ``gateway`` and
``dashboard`` need the gateway extra (``api.gateway``); ``demo`` and ``bench`` are the worker's tools
(``worker.tools``), found by their declared entry points, each loaded only when asked for."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any

from .cli_help import EXIT_CANNOT_LISTEN, Command, fail
from .errors import install_hint
from .gateway.config import GatewayConfig

__all__ = ["TOOLS", "MissingTool", "add_tool_commands", "run_gateway", "worker_tool"]


def add_tool_commands(command: Command) -> None:
    """Adds ``demo``, ``gateway``, ``dashboard`` and ``bench`` to the ``mlxq`` parser."""
    d = command("demo", help="embedded Redis + tiny model + worker + concurrent jobs, no setup")
    d.add_argument("--jobs", type=int, default=8, help="concurrent jobs in the batch phase")
    d.add_argument("--max-tokens", type=int, default=64, help="most tokens each job generates")
    d.add_argument("--size", choices=["tiny", "tiny-tools", "small"], default="tiny",
                   help="generated model (tiny-tools: one whose chat template renders tools, to try tool calls)")
    d.add_argument("--gateway", action="store_true",
                   help="then serve the HTTP gateway in front of the worker and print a curl line (until Ctrl-C)")
    d.add_argument("--port", type=int, default=8000, help="the gateway's port with --gateway (0: any free one)")

    g = command("gateway", help="OpenAI- and Anthropic-compatible HTTP API over the queue")
    g.add_argument("--host", default=None, help="address to listen on (default: MLXQ_GATEWAY_HOST or 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="port (default: MLXQ_GATEWAY_PORT or 8000)")
    g.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug logs one line per request")

    db = command("dashboard", help="the fleet's web dashboard alone, for a host with no gateway (the gateway "
                 "serves it at /dashboard)")
    db.add_argument("--host", default=None, help="address to listen on (default: MLXQ_GATEWAY_HOST or 127.0.0.1)")
    db.add_argument("--port", type=int, default=8001, help="port (0: any free one)")
    db.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="uvicorn's and mlxq's log level")

    b = command("bench", help="raw mlx-lm vs the queue (vs the gateway) on your model, side by side in one run",
                description="Raw mlx-lm vs the queue (vs the HTTP gateway, when its extra is installed) on one "
                            "model: tok/s and TTFT p50 at each N, and their ratios to raw.")
    b.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="an MLX model directory or Hugging Face id (default: the generated small model; tiny with "
                        "--quick)")
    b.add_argument("--concurrency", default=None, metavar="N[,N...]",
                   help="concurrent requests per burst, comma-separated (default: 1,8,32; 1,4 with --quick)")
    b.add_argument("--out", default="bench-out", help="directory for results.md, results.json, chart.png")
    b.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    b.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 64; 16 with --quick)")


TOOLS = "mlxq.tools"  # the entry-point group of the worker side's tools (demo, bench)


class MissingTool(Exception):
    """A command needs an extra (or a tool) this install lacks: it exits 2 (usage), as a bad option does."""


def worker_tool(name: str) -> Callable[..., Any]:
    """A tool of the worker side, declared as an ``mlxq.tools`` entry point (pyproject.toml), which a
    producer-only install cannot load."""
    found = [ep for ep in importlib.metadata.entry_points(group=TOOLS) if ep.name == name]
    if not found:
        raise MissingTool(f"'{name}' is not installed (no {TOOLS} entry point): {install_hint('worker')}")
    try:
        tool: Callable[..., Any] = found[0].load()
    except ImportError as exc:
        raise MissingTool(f"'{name}' needs the worker extra ({exc}): {install_hint('worker')}") from None
    # The tools import MLX only when they run (bench after re-executing itself): say what is missing first.
    missing = [module for module in _WORKER_NEEDS if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingTool(f"'{name}' needs the worker extra (No module named {missing[0]!r}): "
                          f"{install_hint('worker')}")
    return tool


_WORKER_NEEDS = ("mlx", "mlx_lm", "arq")


_GATEWAY_NEEDS = frozenset({"starlette", "uvicorn", "anyio"})


def run_gateway(args: argparse.Namespace) -> int:
    """``mlxq gateway`` and ``mlxq dashboard``: need the gateway extra, which a producer-only install lacks."""
    from dataclasses import replace

    try:
        from .gateway.dashboard import create_dashboard_app
        from .gateway.server import CannotListen, serve
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _GATEWAY_NEEDS:
            raise
        raise MissingTool(f"'{args.command}' needs the gateway extra ({exc}): {install_hint('gateway')}") from None
    config = GatewayConfig.from_env()
    config = replace(config, host=config.host if args.host is None else args.host,
                     port=config.port if args.port is None else args.port)  # --port 0: any free port
    try:
        if args.command == "dashboard":
            return serve(config, log_level=args.log_level, app=create_dashboard_app(config))
        return serve(config, workers=args.workers, log_level=args.log_level)
    except CannotListen as exc:
        return fail(args, exc, EXIT_CANNOT_LISTEN)
