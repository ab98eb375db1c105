"""The ``mlxq`` command: submit, cancel and follow jobs; see the deployment's status and health; serve the HTTP
gateway; run the demo and the benchmark.

``submit`` writes exactly the generated text to stdout (so it pipes) and status to stderr. Producer commands
(``submit``, ``cancel``, ``events``, ``status``, ``health``, ``tenants``) are the producer side's own and
import no worker code, so a producer-only install (``pip install mlxq``) has them; ``gateway`` needs the gateway extra
(``api.gateway``), and ``demo`` and ``bench`` are the worker's tools (``worker.tools``), each loaded only when
asked for. Every failure prints one line (a traceback only with
``--debug``) and exits with a documented status.

This module holds the parser and the dispatch; the commands live beside it by noun: ``cli_jobs`` (submit, cancel,
events, job), ``cli_fleet`` (status, tenants, batches, health), ``cli_tools`` (demo, gateway, dashboard, bench),
and ``cli_help`` (the exit statuses, each command's environment and exit-status help, the help formatter).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .cli_fleet import FLEET_COMMANDS, add_fleet_commands, run_fleet_command
from .cli_help import (
    EXIT_CANNOT_LISTEN,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_WORKER,
    EXIT_OK,
    EXIT_USAGE,
    Formatter,
    epilog,
    fail,
)
from .cli_jobs import add_job_commands, run_job_command
from .cli_tools import TOOLS, MissingTool, add_tool_commands, run_gateway, worker_tool
from .client import Client
from .config import ClientConfig, ToolConfig
from .errors import BadRequest, ConfigError, MlxqError, NoWorker
from .gateway.config import GatewayConfig
from .settings import names, undeclared

__all__ = ["EXIT_CANNOT_LISTEN", "EXIT_FAILED", "EXIT_NO_WORKER", "EXIT_OK", "EXIT_USAGE", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxq", description="MLX language models behind a Redis job queue.",
                                epilog=epilog("mlxq"), formatter_class=Formatter)
    p.add_argument("--debug", action="store_true", help="log at DEBUG and show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=Formatter, epilog=epilog(name), **kwargs)

    add_job_commands(command)  # submit, cancel, events, job
    add_fleet_commands(command)  # status, tenants, batches, health
    add_tool_commands(command)  # demo, gateway, dashboard, bench
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlxq`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in _undeclared(os.environ):
        print(f"mlxq: warning: {line}", file=sys.stderr)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (ConfigError, MissingTool, BadRequest) as exc:
        return fail(args, exc, EXIT_USAGE)
    except NoWorker as exc:
        return fail(args, exc, EXIT_NO_WORKER)
    except MlxqError as exc:  # Redis unreachable or refusing us, an unknown job, a failed job
        return fail(args, exc, EXIT_FAILED)
    except Exception as exc:  # a bug: still one line, unless asked for the traceback
        if args.debug:
            raise
        print(f"mlxq: internal error: {exc!r} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAILED


def _undeclared(env: Mapping[str, str]) -> list[str]:
    """Warnings for the ``MLXQ_*`` variables no side declares. The producer side's names first; only where one
    is not among them, every side's (an environment shared with workers holds theirs), through the ``settings``
    entry point, as the tools are found (its module reads no MLX or arq); where it cannot load, nothing is said,
    as a worker's variable cannot be told from a typo."""
    known = names([ClientConfig, GatewayConfig, ToolConfig])
    if not undeclared(env, known):
        return []
    found = [ep for ep in importlib.metadata.entry_points(group=TOOLS) if ep.name == "settings"]
    try:
        groups = found[0].load() if found else ()
    except ImportError:
        groups = ()
    return undeclared(env, names(cls for _, cls in groups)) if groups else []


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        run_demo = worker_tool("demo")
        return int(run_demo(jobs=args.jobs, max_tokens=args.max_tokens, size=args.size,
                            gateway_port=args.port if args.gateway else None))
    if args.command == "bench":
        return int(worker_tool("bench")(args))
    if args.command in ("gateway", "dashboard"):
        return run_gateway(args)
    config = ClientConfig.from_env()  # a bad MLXQ_* value: one line, before anything connects
    return asyncio.run(_producer_command(args, config))


async def _producer_command(args: argparse.Namespace, config: ClientConfig) -> int:
    tenant = args.tenant if args.command == "batches" else None  # a batch's owner, as a gateway key's tenant
    async with Client(config=config, tenant=tenant) as client:
        if args.command in FLEET_COMMANDS:
            return await run_fleet_command(client, args)
        return await run_job_command(client, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
