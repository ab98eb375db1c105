"""Which BLAS mlx calls on Linux, and how to make Debian's OpenBLAS run its fast kernels (for ``mlxq bench``).

mlx-cpu's bundled reference BLAS is slow, so benchmarks preload Debian's OpenBLAS. That OpenBLAS (0.3.21,
``DYNAMIC_ARCH``) picks its kernels from the CPU model it knows; on a CPU newer than itself it falls back to its
generic SSE3 kernels ("Prescott"), much slower than the CPU's own. :func:`coretype_for` names the
fastest kernel set the CPU's flags allow, for ``OPENBLAS_CORETYPE``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["OPENBLAS", "blas_of", "coretype_for", "cpu_flags", "openblas", "openblas_core"]

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
# OpenBLAS's kernel sets that predate AVX2: on a CPU with AVX2 or AVX-512 they mean it did not know the model.
_GENERIC_CORES = frozenset({"prescott", "katmai", "coppermine", "northwood", "core2", "penryn", "dunnington",
                            "nehalem", "atom", "banias", "unknown"})
_SKYLAKEX_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_HASWELL_FLAGS = frozenset({"avx2", "fma"})


def blas_of(pid: int | str = "self") -> str:
    """Which BLAS serves mlx in a process: a preloaded one it has mapped, else mlx-cpu's bundled one.

    Only LD_PRELOAD entries count (child processes inherit ours): numpy maps an OpenBLAS of its own that
    mlx never calls.
    """
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "unknown (no /proc)"
    mapped = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    for lib in re.split(r"[\s:]+", os.environ.get("LD_PRELOAD", "")):
        if "blas" in lib.lower() and (lib in mapped or os.path.realpath(lib) in mapped):
            if "openblas" not in lib.lower():
                return f"preloaded ({lib})"
            core = openblas_core()
            return f"openblas ({lib}{', ' + core + ' kernels' if core else ''})"
    return "bundled (mlx-cpu reference BLAS)"


@functools.cache
def openblas(path: Path = OPENBLAS) -> Any:
    """OpenBLAS through ctypes (the preloaded copy, when it is), or None when it does not load."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    return lib if hasattr(lib, "openblas_set_num_threads") else None


def openblas_core(path: Path = OPENBLAS) -> str | None:
    """The kernel set OpenBLAS chose for this CPU ("SkylakeX", "Prescott", ...), or None."""
    lib = openblas(path)
    if lib is None or not hasattr(lib, "openblas_get_corename"):
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    name: bytes = lib.openblas_get_corename()
    return name.decode()


def coretype_for(core: str | None, flags: frozenset[str]) -> str | None:
    """``OPENBLAS_CORETYPE`` to set when OpenBLAS fell back to generic kernels the CPU outruns, else None."""
    if core is None or core.lower() not in _GENERIC_CORES:
        return None
    if flags >= _SKYLAKEX_FLAGS:
        return "SkylakeX"
    if flags >= _HASWELL_FLAGS:
        return "Haswell"
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()
