"""``python3 -m tests.perf``: the research benchmarks (see the package's docstring); run from the checkout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .suite import run_suite


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf",
                                description="The research benchmarks; writes results.md (with the targets "
                                            "tests/perf/README.md lists, PASS or MISS), results.json and "
                                            "chart.png.")
    p.add_argument("--out", default="perf-out", help="directory for results.md, results.json, chart.png")
    p.add_argument("--quick", action="store_true", help="a smoke run of a minute or so")
    p.add_argument("--sizes", default=None, help="comma-separated generated model sizes (default: tiny,small)")
    p.add_argument("--concurrency", default=None, help="comma-separated N values (default: 1,8,32,64)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: 64)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_suite(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
