"""Helpers for the engine tests that run a real tiny MLX model (the fakes' tests import none of this)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxq.engine.core.scheduler import Scheduler
from tests.engine.fakes import Run


def drive(s: Scheduler, run: Run, stream: mx.Stream, until: Any = None, steps: int = 2000) -> None:
    """Step ``s`` on ``stream`` (the MLX thread's part, here in the test's thread) until it has no work left, or
    ``until()`` holds; fails after ``steps`` steps."""
    with mx.stream(stream):
        for _ in range(steps):
            if not s.has_work or (until is not None and until()):
                return
            run.step(s)
    raise AssertionError("did not finish")
