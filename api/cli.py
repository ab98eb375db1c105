"""The ``mlxq`` command: submit, cancel and follow jobs; see the deployment's status and health; serve the HTTP
gateway; run the demo and the benchmark.

``submit`` writes exactly the generated text to stdout (so it pipes) and status to stderr. Producer commands
(``submit``, ``cancel``, ``events``, ``status``, ``health``, ``tenants``) are the producer side's own and
import no worker code, so a producer-only install (``pip install mlxq``) has them; ``gateway`` needs the gateway extra
(``api.gateway``), and ``demo`` and ``bench`` are the worker's tools (``worker.tools``), each loaded only when
asked for. Every failure prints one line (a traceback only with
``--debug``) and exits with a documented status.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .client import Client
from .config import ClientConfig, ToolConfig
from .errors import BadRequest, ConfigError, JobFailed, MlxqError, NoWorker, describe, elsewhere_hint, install_hint
from .gateway.config import GatewayConfig, max_tokens_fields
from .schema import ChatMessage, DoneEvent, ErrorEvent, GenerateRequest
from .settings import help_text, names, undeclared

__all__ = ["EXIT_CANNOT_LISTEN", "EXIT_FAILED", "EXIT_NO_WORKER", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed or timed out, an unknown job, Redis unreachable or refusing, unhealthy
EXIT_USAGE = 2  # a bad request, option or configuration value; a missing extra or tool
EXIT_NO_WORKER = 3  # no live worker serves the model
EXIT_CANNOT_LISTEN = 4  # gateway, dashboard: the address is in use (or not this host's), or the server did not start
EXIT_INTERRUPTED = 130

# Each command's variables, made from their declarations (api/settings.py).
_CLIENT_ENV = help_text([ClientConfig])
_GATEWAY_ENV = f"{help_text([GatewayConfig])} and its queue client's:\n{_CLIENT_ENV}"
_DEMO_ENV = help_text([ClientConfig, ToolConfig], only={"MLXQ_REDIS_URL", "MLXQ_MODEL_CACHE"}, notes={
    "MLXQ_REDIS_URL": "a Redis to use instead of the embedded redis-server (default: embed one)"})
_BENCH_ENV = f"""\
  MLXQ_*                the worker variables (e.g. MLXQ_STREAM_INTERVAL_MS, MLXQ_STREAM_RATE, MLXQ_ADMIT_WAIT_MS)
                        apply to its worker, which inherits them
{help_text([ToolConfig], pad=22)}\
  OPENBLAS_CORETYPE     the OpenBLAS core on Linux (default: the one it picks for this CPU)
  OPENBLAS_NUM_THREADS  OpenBLAS threads of every path (default: one per core)
"""

_BAD_CONFIG = "2    a bad request, option or configuration value"
_REDIS_DOWN = "Redis unreachable or refusing"
_EXITS = {
    "mlxq": [
        "0    success",
        f"1    the job ended with an error or timed out; an unknown job; {_REDIS_DOWN}; unhealthy",
        f"{_BAD_CONFIG}; a missing extra or tool (demo: no redis-server)",
        "3    no live worker serves the model (submit, unless --queue-anyway)",
        "4    gateway, dashboard: the address is in use (or not this host's), or the server did not start",
    ],
    "submit": [
        "0    the job ended done (stop, length or cancelled); with --no-wait, it was queued",
        f"1    the job ended with an error, or no end within --timeout; {_REDIS_DOWN}",
        _BAD_CONFIG,
        "3    no live worker serves the model (unless --queue-anyway); nothing was queued",
    ],
    "cancel": ["0    cancel requested, or the job had ended already", f"1    an unknown job; {_REDIS_DOWN}",
               _BAD_CONFIG],
    "events": ["0    every event up to the terminal one (done or error) was printed",
               f"1    an unknown job, or no terminal event within --timeout; {_REDIS_DOWN}", _BAD_CONFIG],
    "job": ["0    the job was found (queued, running, ended: its result, or its error)",
            f"1    no such job, or nothing of it is kept any more; {_REDIS_DOWN}", _BAD_CONFIG],
    "status": ["0    the report was printed", f"1    {_REDIS_DOWN}", _BAD_CONFIG],
    "tenants": ["0    the tenants were listed, or the policy set or removed", f"1    {_REDIS_DOWN}",
                f"{_BAD_CONFIG} (a malformed name, a weight of 0 or less, a negative cap)"],
    "batches": ["0    listed, shown, created, cancelled, or the results printed (feed: stopped by Ctrl-C)",
                f"1    an unknown batch, or one of another tenant; {_REDIS_DOWN}",
                f"{_BAD_CONFIG} (a bad endpoint or file, a batch that cannot be cancelled)"],
    "health": ["0    a live worker serves the model (any model without --model)",
               f"1    none does (unhealthy); {_REDIS_DOWN}", _BAD_CONFIG],
    "demo": ["0    the demo ran (with --gateway: then Ctrl-C or SIGTERM stopped it cleanly)",
             "1    a job or the worker failed (the worker's log is kept; its path is printed)",
             "2    a bad option; the worker extra is missing; no redis-server to embed (macOS: brew install redis)"],
    "gateway": ["0    stopped by SIGINT/SIGTERM after a clean shutdown (uvicorn then re-raises the signal: a shell "
                "sees 130 or 143)",
                "2    a bad option or configuration value; the gateway extra is missing",
                "4    it could not listen (the address is in use, or not this host's) or start"],
    "dashboard": ["0    stopped by SIGINT/SIGTERM", "2    a bad option or configuration value; the gateway extra "
                  "is missing", "4    it could not listen (the address is in use, or not this host's) or start"],
    "bench": ["0    the results were written", "1    a run failed (the line says which)",
              "2    a bad option; the worker or bench extra is missing"],
}
_ENV = {"demo": _DEMO_ENV, "gateway": _GATEWAY_ENV, "dashboard": _GATEWAY_ENV, "bench": _BENCH_ENV,
        "batches": _GATEWAY_ENV}


def _epilog(command: str) -> str:
    """A command's environment variables and exit statuses, for the end of its ``--help``."""
    exits = "\n".join(f"  {line}" for line in [*_EXITS[command], "130  interrupted"])
    return f"environment:\n{_ENV.get(command, _CLIENT_ENV)}\nexit status:\n{exits}\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxq", description="MLX language models behind a Redis job queue.",
                                epilog=_epilog("mlxq"), formatter_class=_Formatter)
    p.add_argument("--debug", action="store_true", help="log at DEBUG and show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_Formatter, epilog=_epilog(name), **kwargs)

    s = command("submit", help="submit a job and stream its text to stdout",
                description="Submit a job; its text goes to stdout, status to stderr.")
    s.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (a raw prompt, or the user message with --chat); '-' reads standard input")
    s.add_argument("--file", type=Path, default=None, help="read the prompt from this file")
    s.add_argument("--model", required=True, help="model name: a worker's MLXQ_MODEL_NAME (or MLXQ_MODEL)")
    s.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default: what fits the "
                   "model's context after the prompt, up to the workers' MLXQ_MAX_TOKENS, as the gateway serves a "
                   "request naming none)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--priority", type=int, default=0, help="higher runs first (-100..100)")
    s.add_argument("--tenant", default="default", help="whose job it is (fair share and caps: mlxq tenants)")
    s.add_argument("--expires-in", type=float, default=None,
                   help="seconds it may wait queued before it ends error(expired) (default: MLXQ_JOB_EXPIRY)")
    s.add_argument("--keep-result", type=int, default=None, metavar="SECONDS",
                   help="keep its result this long after its end (`mlxq job`; default: MLXQ_KEEP_RESULT)")
    s.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    s.add_argument("--system", default=None, help="with --chat: a system message before it")
    s.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    s.add_argument("--queue-anyway", action="store_true",
                   help="queue it even when no live worker serves the model (one may start before it expires)")
    s.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")

    c = command("cancel", help="cancel a job")
    c.add_argument("job_id")

    e = command("events", help="print a job's events as JSON lines (replayed, then live)")
    e.add_argument("job_id")
    e.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds")

    j = command("job", help="a job's result by id (kept for hours after its end), or where it stands",
                description="A job's status and, once it ended, its result (text, reasoning, tool calls, usage, "
                            "timings) or its error: read from what is kept of it (its request's keep_result_s, or "
                            "the workers' MLXQ_KEEP_RESULT), long after its events expired.")
    j.add_argument("job_id")
    j.add_argument("--json", action="store_true", help="print JSON (for scripts)")

    st = command("status", help="queues and live workers, from Redis")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh in place every SECONDS (2 when given alone) until interrupted")
    st.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N refreshes")

    t = command("tenants", help="tenants' policies and live use; set or remove a policy",
                description="Each tenant's policy (weight, caps) and live use: jobs queued and running, tokens a "
                            "minute, its share of them. Policies live in Redis and apply fleet-wide at once; a "
                            "tenant without one has weight 1 and no caps.")
    t.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    tsub = t.add_subparsers(dest="action", metavar="ACTION")
    ts = tsub.add_parser("set", help="set fields of a tenant's policy (the others keep theirs)",
                         formatter_class=_Formatter)
    ts.add_argument("name", help="the tenant: 1 to 64 of A-Z a-z 0-9 . _ -")
    ts.add_argument("--weight", type=float, default=None, help="its share of the fleet's work, against others' "
                    "(above 0; default 1)")
    ts.add_argument("--max-running", type=int, default=None, metavar="N", help="its jobs running at once, "
                    "fleet-wide (0: no cap)")
    ts.add_argument("--max-queued", type=int, default=None, metavar="N", help="its jobs queued; a submit over "
                    "it is refused, QueueFull / HTTP 429 (0: no cap)")
    ts.add_argument("--tokens-per-minute", type=int, default=None, metavar="N", help="prompt + generated "
                    "tokens of its jobs a minute; over it, its jobs wait queued (0: no cap)")
    tr = tsub.add_parser("rm", help="remove a tenant's policy (its queued jobs stay, under the default policy)")
    tr.add_argument("name")

    bt = command("batches", help="OpenAI batches on the queue: list, show, create, cancel, results, feed",
                 description="Batches (OpenAI's Batch API) of the tenant --tenant names. Any gateway feeds "
                             "them; `feed` runs a feeder here, for deployments without a gateway.")
    bt.add_argument("--tenant", default="default", help="whose batches (a gateway maps each API key to one)")
    bt.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    bsub = bt.add_subparsers(dest="action", metavar="ACTION")
    bsub.add_parser("list", help="the tenant's batches, newest first (the default)")
    for name, what in (("show", "one batch's object"), ("cancel", "cancel a batch (what finished is kept)"),
                       ("results", "an ended batch's output and error lines, as JSONL")):
        bsub.add_parser(name, help=what).add_argument("batch_id")
    bc = bsub.add_parser("create", help="upload a JSONL file of request lines and start a batch of them")
    bc.add_argument("file", type=Path, help="JSONL: one {custom_id, method, url, body} a line")
    bc.add_argument("--endpoint", default="/v1/chat/completions",
                    help="/v1/chat/completions, /v1/completions, /v1/responses or /v1/embeddings")
    bsub.add_parser("feed", help="feed open batches from here until interrupted (needs the gateway extra)")

    h = command("health", help="exit 0 if a live worker serves the model (any model without --model), else 1")
    h.add_argument("--model", default=None, help="the model to check")

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
    return p


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout (environment, exit status) and shows each option's default, if it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})"


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
    except (ConfigError, _MissingTool, BadRequest) as exc:
        return _fail(args, exc, EXIT_USAGE)
    except NoWorker as exc:
        return _fail(args, exc, EXIT_NO_WORKER)
    except MlxqError as exc:  # Redis unreachable or refusing us, an unknown job, a failed job
        return _fail(args, exc, EXIT_FAILED)
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


def _fail(args: argparse.Namespace, exc: Exception, status: int) -> int:
    if args.debug:
        logging.getLogger(__name__).exception("mlxq %s failed", args.command)
    print(f"mlxq: {exc}", file=sys.stderr)
    return status


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        run_demo = _worker_tool("demo")
        return int(run_demo(jobs=args.jobs, max_tokens=args.max_tokens, size=args.size,
                            gateway_port=args.port if args.gateway else None))
    if args.command == "bench":
        return int(_worker_tool("bench")(args))
    if args.command in ("gateway", "dashboard"):
        return _gateway(args)
    config = ClientConfig.from_env()  # a bad MLXQ_* value: one line, before anything connects
    return asyncio.run(_producer_command(args, config))


TOOLS = "mlxq.tools"  # the entry-point group of the worker side's tools (demo, bench)


class _MissingTool(Exception):
    pass


def _worker_tool(name: str) -> Callable[..., Any]:
    """A tool of the worker side, declared as an ``mlxq.tools`` entry point (pyproject.toml), which a
    producer-only install cannot load."""
    found = [ep for ep in importlib.metadata.entry_points(group=TOOLS) if ep.name == name]
    if not found:
        raise _MissingTool(f"'{name}' is not installed (no {TOOLS} entry point): {install_hint('worker')}")
    try:
        tool: Callable[..., Any] = found[0].load()
    except ImportError as exc:
        raise _MissingTool(f"'{name}' needs the worker extra ({exc}): {install_hint('worker')}") from None
    # The tools import MLX only when they run (bench after re-executing itself): say what is missing first.
    missing = [module for module in _WORKER_NEEDS if importlib.util.find_spec(module) is None]
    if missing:
        raise _MissingTool(f"'{name}' needs the worker extra (No module named {missing[0]!r}): "
                           f"{install_hint('worker')}")
    return tool


_WORKER_NEEDS = ("mlx", "mlx_lm", "arq")


_GATEWAY_NEEDS = frozenset({"starlette", "uvicorn", "anyio"})


def _gateway(args: argparse.Namespace) -> int:
    """``mlxq gateway`` and ``mlxq dashboard``: need the gateway extra, which a producer-only install lacks."""
    from dataclasses import replace

    try:
        from .gateway.dashboard import create_dashboard_app
        from .gateway.server import CannotListen, serve
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _GATEWAY_NEEDS:
            raise
        raise _MissingTool(f"'{args.command}' needs the gateway extra ({exc}): {install_hint('gateway')}") from None
    config = GatewayConfig.from_env()
    config = replace(config, host=config.host if args.host is None else args.host,
                     port=config.port if args.port is None else args.port)  # --port 0: any free port
    try:
        if args.command == "dashboard":
            return serve(config, log_level=args.log_level, app=create_dashboard_app(config))
        return serve(config, workers=args.workers, log_level=args.log_level)
    except CannotListen as exc:
        return _fail(args, exc, EXIT_CANNOT_LISTEN)


async def _producer_command(args: argparse.Namespace, config: ClientConfig) -> int:
    tenant = args.tenant if args.command == "batches" else None  # a batch's owner, as a gateway key's tenant
    async with Client(config=config, tenant=tenant) as client:
        if args.command == "cancel":
            return await _cancel(client, args.job_id)
        if args.command == "events":
            async for ev in client.events(args.job_id, timeout=args.timeout):
                print(ev.model_dump_json(), flush=True)
            return EXIT_OK
        if args.command == "status":
            return await _status(client, args.json, args.watch, args.count)
        if args.command == "job":
            return await _job(client, args.job_id, args.json)
        if args.command == "health":
            return await _health(client, args.model)
        if args.command == "tenants":
            return await _tenants(client, args)
        if args.command == "batches":
            return await _batches(client, args)
        return await _submit(client, args)


async def _cancel(client: Client, rid: str) -> int:
    if await client.cancel(rid):
        print(f"cancel requested for {rid}", file=sys.stderr)
    else:
        print(f"job {rid} already ended; nothing to cancel", file=sys.stderr)
    return EXIT_OK


async def _job(client: Client, rid: str, as_json: bool) -> int:
    from .status import render_job

    view = await client.job(rid)
    if view.status == "unknown":
        print(f"mlxq: job {rid} is unknown, or nothing of it is kept any more (its result is kept "
              "MLXQ_KEEP_RESULT seconds, or its request's keep_result_s)", file=sys.stderr)
        return EXIT_FAILED
    text, data = render_job(view)
    print(json.dumps(data, indent=2) if as_json else text)
    return EXIT_OK


async def _status(client: Client, as_json: bool, watch: float | None, count: int | None) -> int:
    from .status import collect, render

    shown = 0
    while True:
        report = await collect(client)
        text = json.dumps(report.to_json(), indent=2) if as_json else render(report)
        if watch is None:
            print(text)
            return EXIT_OK
        sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home, clear: refresh in place
        sys.stdout.flush()
        shown += 1
        if count is not None and shown >= count:
            return EXIT_OK
        await asyncio.sleep(watch)


async def _tenants(client: Client, args: argparse.Namespace) -> int:
    from .status import tenant_table

    if args.action == "set":
        policy = await client.set_tenant(args.name, weight=args.weight, max_running=args.max_running,
                                         max_queued=args.max_queued, tokens_per_minute=args.tokens_per_minute)
        print(f"tenant {args.name}: weight {policy.weight:g}, max-running {policy.max_running or '-'}, "
              f"max-queued {policy.max_queued or '-'}, tokens-per-minute {policy.tokens_per_minute or '-'}")
        return EXIT_OK
    if args.action == "rm":
        had = await client.remove_tenant(args.name)
        print(f"tenant {args.name}: " + ("policy removed; its jobs go on under the default policy" if had
                                         else "had no policy entry (the default policy)"))
        return EXIT_OK
    found = await client.tenants()
    if args.json:
        print(json.dumps([t.to_json() for t in found], indent=2))
    elif not found:
        print("no tenants with a policy, jobs queued or running, or tokens over the last minute (every tenant has "
              "the default policy: weight 1, no caps)")
    else:
        print("\n".join(tenant_table(found)))
        if not all(t.named for t in found):
            print("(* no policy entry: the default policy; policies live in Redis: a Redis restarted empty loses "
                  "them)")
    return EXIT_OK


async def _batches(client: Client, args: argparse.Namespace) -> int:
    action = args.action or "list"
    if action == "feed":
        return await _feed(client)
    if action == "results":
        out, err = await client.batch_results(args.batch_id)
        for line in out + err:
            print(json.dumps(line))
        return EXIT_OK
    if action == "list":
        found = await client.batches(limit=100)
        if args.json:
            print(json.dumps(found, indent=2))
        for b in [] if args.json else found:
            print(_batch_line(b))
        return EXIT_OK
    if action == "create":
        b = await client.create_batch(args.file, endpoint=args.endpoint)
    elif action == "cancel":
        b = await client.cancel_batch(args.batch_id)
    else:
        b = await client.batch(args.batch_id)
    print(json.dumps(b, indent=2) if args.json else _batch_line(b))
    return EXIT_OK


def _batch_line(b: dict[str, Any]) -> str:
    counts = b["request_counts"]
    files = " ".join(f"{k.removesuffix('_file_id')} {b[k]}" for k in ("output_file_id", "error_file_id") if b[k])
    return (f"{b['id']}  {b['status']:<11} {b['endpoint']:<20} {counts['completed']}/{counts['total']} done, "
            f"{counts['failed']} failed{'  ' + files if files else ''}")


async def _feed(client: Client) -> int:
    if importlib.util.find_spec("starlette") is None:
        raise _MissingTool(f"mlxq batches feed reads lines as the gateway does: {install_hint('gateway')}")
    from .feeder import BatchFeeder, FeederSettings
    from .gateway.batch_lines import BatchLines

    config = GatewayConfig.from_env()
    feeder = BatchFeeder(client, client.batch_store(), BatchLines(config),
                         FeederSettings(window=max(1, config.batch_window)))
    print(f"feeding batches ({feeder.id}) until interrupted", file=sys.stderr)
    await feeder.run()
    return EXIT_OK


async def _health(client: Client, model: str | None) -> int:
    workers = await client.workers()
    serving = [w for w in workers if any(w.serves(m.name) for m in w.models) and (model is None or w.serves(model))]
    what = f"model {model!r}" if model else "any model"
    if not serving:
        served = sorted({m.name for w in workers for m in w.models if w.serves(m.name)})
        listed = ", ".join(repr(m) for m in served) or "none"
        hint = "" if served else elsewhere_hint(await client.other_prefixes(), model)
        print(f"mlxq: unhealthy: no live worker serves {what} (models served now: {listed}){hint}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ok: {len(serving)} live worker(s) serve {what}: {', '.join(w.id for w in serving)}")
    return EXIT_OK


def _prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        if args.prompt is not None:
            raise BadRequest("give the prompt as an argument or with --file, not both")
        try:
            return str(args.file.read_text())
        except OSError as exc:
            raise BadRequest(f"cannot read the prompt from {args.file}: {exc.strerror}") from None
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is None:
        raise BadRequest("no prompt: give it as an argument, '-' for standard input, or --file PATH")
    return str(args.prompt)


def _request(args: argparse.Namespace) -> GenerateRequest:
    text = _prompt(args)
    messages = None
    if args.chat:
        messages = [ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(ChatMessage(role="user", content=text))
    elif args.system:
        raise BadRequest("--system needs --chat")
    try:
        return GenerateRequest(
            model=args.model, prompt=None if args.chat else text, messages=messages,
            **max_tokens_fields(args.max_tokens), temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            stop=args.stop, priority=args.priority, expires_in=args.expires_in, tenant=args.tenant,
            keep_result_s=args.keep_result,
        )
    except ValidationError as exc:
        raise BadRequest(describe(exc)) from None


async def _submit(client: Client, args: argparse.Namespace) -> int:
    try:
        req = _request(args)
        rid = await client.submit(req, require_worker=not args.queue_anyway)
    except BadRequest as exc:
        raise BadRequest(f"bad request: {exc}") from None
    except NoWorker as exc:
        print(f"mlxq: {exc}; nothing was queued (--queue-anyway queues it for a worker that starts before it "
              "expires)", file=sys.stderr)
        return EXIT_NO_WORKER
    if args.no_wait:
        print(rid)
        return EXIT_OK
    print(f"job {rid} queued on {client.keys.queue(req.model, req.tenant)}", file=sys.stderr)
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
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
