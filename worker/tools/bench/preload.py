"""OpenBLAS for the benchmarks: re-execute the command with Debian's OpenBLAS preloaded when it is installed.

mlx-cpu's bundled reference BLAS is so slow that batching gains nothing on Linux. ``LD_PRELOAD`` must be set
before the process starts, so the command re-executes itself with it: the in-process raw path and the worker
subprocesses (which inherit the environment) then both use it. Where OpenBLAS does not know the CPU and falls
back to its generic kernels, ``OPENBLAS_CORETYPE`` names the fastest the CPU's flags allow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..blas import OPENBLAS, coretype_for, cpu_flags, openblas_core
from .runs import say

__all__ = ["REEXEC_MARK", "ROOT", "reexec_with_openblas"]

REEXEC_MARK = "MLXQ_BENCH_REEXEC"  # set in the re-executed process: never re-exec twice
ROOT = Path(__file__).resolve().parents[3]  # the checkout (an editable install runs from it)


def reexec_with_openblas(argv: Sequence[str], path: Path = ROOT) -> None:
    """Re-execute ``python ARGV...`` with OpenBLAS in ``LD_PRELOAD`` (Linux, if installed), ``path`` first on
    ``PYTHONPATH``; returns (doing nothing) where that does not apply or has been done."""
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_MARK):
        return
    if not OPENBLAS.exists():
        say(f"BLAS: {OPENBLAS} is missing, so mlx-cpu's slow bundled BLAS runs and batching gains little "
            "(install it: apt-get install libopenblas0-pthread)")
        return
    preload = os.environ.get("LD_PRELOAD", "")
    core = None if os.environ.get("OPENBLAS_CORETYPE") else openblas_core(OPENBLAS)  # the operator's stands
    coretype = coretype_for(core, cpu_flags())
    if str(OPENBLAS) in preload and coretype is None:
        return
    env = {**os.environ, REEXEC_MARK: "1"}
    if str(OPENBLAS) not in preload:
        env["LD_PRELOAD"] = " ".join(p for p in (str(OPENBLAS), preload) if p)
    if coretype is not None:  # the workers inherit it
        env["OPENBLAS_CORETYPE"] = coretype
        say(f"BLAS: OpenBLAS does not know this CPU and chose its generic {core} kernels; setting "
            f"OPENBLAS_CORETYPE={coretype}, which the CPU's flags allow (on an AVX-512 Xeon the generic kernels ran "
            "gemm 4-5x slower)")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    say(f"BLAS: re-executing with LD_PRELOAD={env['LD_PRELOAD']}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
