"""The ``mlxq`` command's exit statuses and the end of each command's ``--help``: the environment variables it
reads and the statuses it exits with; the help formatter every command's parser uses."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from .config import ClientConfig, ToolConfig
from .gateway.config import GatewayConfig
from .settings import help_text

__all__ = ["EXIT_CANNOT_LISTEN", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_NO_WORKER", "EXIT_OK", "EXIT_USAGE",
           "Command", "Formatter", "epilog", "fail"]

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed or timed out, an unknown job, Redis unreachable or refusing, unhealthy
EXIT_USAGE = 2  # a bad request, option or configuration value; a missing extra or tool
EXIT_NO_WORKER = 3  # no live worker serves the model
EXIT_CANNOT_LISTEN = 4  # gateway, dashboard: the address is in use (or not this host's), or the server did not start
EXIT_INTERRUPTED = 130

Command = Callable[..., argparse.ArgumentParser]  # adds one command's parser: ``command(name, help=...)``

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
                f"{_BAD_CONFIG} (a bad endpoint, file or output expiry, a batch that cannot be cancelled)"],
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


def epilog(command: str) -> str:
    """A command's environment variables and exit statuses, for the end of its ``--help``."""
    exits = "\n".join(f"  {line}" for line in [*_EXITS[command], "130  interrupted"])
    return f"environment:\n{_ENV.get(command, _CLIENT_ENV)}\nexit status:\n{exits}\n"



class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout (environment, exit status) and shows each option's default, if it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})"


def fail(args: argparse.Namespace, exc: Exception, status: int) -> int:
    """Print the one line a failure exits with (its traceback too with ``--debug``); returns ``status``."""
    if args.debug:
        logging.getLogger("mlxq.api.cli").exception("mlxq %s failed", args.command)
    print(f"mlxq: {exc}", file=sys.stderr)
    return status
