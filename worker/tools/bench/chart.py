"""The benchmark's chart (chart.png).
"""

from __future__ import annotations

from pathlib import Path

from .runs import BenchResult


def _chart(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result.sizes), figsize=(5.5 * len(result.sizes), 4.2), squeeze=False)
    for ax, s in zip(axes[0], result.sizes, strict=True):
        ns = [r.n for r in s.rows]
        for label, pick in (("raw BatchGenerator", lambda r: r.raw), ("queue", lambda r: r.queue),
                            ("serial", lambda r: r.serial)):
            ax.plot(ns, [pick(r).tok_s for r in s.rows], marker="o", label=label)
        if s.gateway is not None:
            ax.plot([r.n for r in s.gateway.rows], [r.gateway.tok_s for r in s.gateway.rows], marker="s",
                    linestyle="--", label="HTTP gateway")
        if all(r.engine is not None for r in s.rows):
            ax.plot(ns, [r.engine.tok_s for r in s.rows if r.engine is not None], marker=".", linestyle=":",
                    label="engine, no Redis")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set(title=f"{s.size} model", xlabel="concurrent requests N", ylabel="aggregate tok/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    m = result.machine
    fig.suptitle(f"mlxq bench · BLAS: {m['blas'].split(' ')[0]} · {m['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
