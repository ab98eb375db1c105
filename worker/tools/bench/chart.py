"""The benchmarks' chart (chart.png): panels of lines over the concurrency N, on a log2 axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Panel", "Series", "draw"]


@dataclass(frozen=True, slots=True)
class Series:
    """One line: a value per N."""

    label: str
    ns: list[int]
    values: list[float]
    marker: str = "o"
    linestyle: str = "-"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)


def draw(panels: list[Panel], title: str, path: Path) -> None:
    """Write the panels side by side to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        ns = sorted({n for s in panel.series for n in s.ns})
        for s in panel.series:
            ax.plot(s.ns, s.values, marker=s.marker, linestyle=s.linestyle, label=s.label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set(title=panel.title, xlabel="concurrent requests N", ylabel=panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
