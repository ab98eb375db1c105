"""``mlxq submit``, ``cancel``, ``events`` and ``job``: one job's commands, its options and what each prints.

``submit`` writes exactly the generated text to stdout (so it pipes) and status to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from .cli_help import EXIT_FAILED, EXIT_NO_WORKER, EXIT_OK, Command
from .client import Client
from .errors import BadRequest, JobFailed, MlxqError, NoWorker, describe
from .gateway.config import max_tokens_fields
from .schema import ChatMessage, DoneEvent, ErrorEvent, GenerateRequest

__all__ = ["add_job_commands", "run_job_command"]


def add_job_commands(command: Command) -> None:
    """Adds ``submit``, ``cancel``, ``events`` and ``job`` to the ``mlxq`` parser."""
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


async def run_job_command(client: Client, args: argparse.Namespace) -> int:
    """Runs one of this module's commands; returns the exit status."""
    if args.command == "cancel":
        return await _cancel(client, args.job_id)
    if args.command == "events":
        async for ev in client.events(args.job_id, timeout=args.timeout):
            print(ev.model_dump_json(), flush=True)
        return EXIT_OK
    if args.command == "job":
        return await _job(client, args.job_id, args.json)
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
