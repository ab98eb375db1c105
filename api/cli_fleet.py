"""``mlxq status``, ``tenants``, ``batches`` and ``health``: the fleet's commands, read from (and, for tenants'
policies and batches, written to) Redis."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from .cli_help import EXIT_FAILED, EXIT_OK, Command, Formatter
from .cli_tools import MissingTool
from .client import Client
from .errors import elsewhere_hint, install_hint
from .gateway.config import GatewayConfig

__all__ = ["FLEET_COMMANDS", "add_fleet_commands", "run_fleet_command"]

FLEET_COMMANDS = frozenset({"status", "tenants", "batches", "health"})


def add_fleet_commands(command: Command) -> None:
    """Adds ``status``, ``tenants``, ``batches`` and ``health`` to the ``mlxq`` parser."""
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
                         formatter_class=Formatter)
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
    bc.add_argument("--output-expires-after", type=int, default=None, metavar="SECONDS",
                    help="the output and error files expire this long after they are written (3600 to 2592000; "
                         "default: the deployment's file retention)")
    bsub.add_parser("feed", help="feed open batches from here until interrupted (needs the gateway extra)")

    h = command("health", help="exit 0 if a live worker serves the model (any model without --model), else 1")
    h.add_argument("--model", default=None, help="the model to check")


async def run_fleet_command(client: Client, args: argparse.Namespace) -> int:
    """Runs one of this module's commands; returns the exit status."""
    if args.command == "status":
        return await _status(client, args.json, args.watch, args.count)
    if args.command == "tenants":
        return await _tenants(client, args)
    if args.command == "batches":
        return await _batches(client, args)
    return await _health(client, args.model)


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
        seconds = args.output_expires_after
        b = await client.create_batch(args.file, endpoint=args.endpoint, output_expires_after=None if seconds is None
                                      else {"anchor": "created_at", "seconds": seconds})
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
        raise MissingTool(f"mlxq batches feed reads lines as the gateway does: {install_hint('gateway')}")
    from .feeder import BatchFeeder, FeederSettings
    from .gateway.batch_lines import BatchLines

    config = GatewayConfig.from_env()
    feeder = BatchFeeder(client, client.batch_store(), BatchLines(config),
                         FeederSettings(window=max(1, config.batch_window), no_worker_grace_s=config.batch_no_worker_s))
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
