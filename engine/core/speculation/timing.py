"""Which steps of a speculative batch time their ``k`` (pure Python): each step's wall time goes to the
:class:`~engine.core.speculation.tuner.Tuner` as a sample of its k, as a cost charged to it, or not at all. The
batch (``engine/mlx/speculation/batch.py``) says when each step starts, its rows and k, the shape it ran in and
what else it did; the rules are here, where a test can feed them made-up times."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from .tuner import Tuner

__all__ = ["StepTimer"]


@dataclass(slots=True)
class _Step:
    """The step being timed."""

    rows: int
    k: int
    start: float
    prior: int  # the k of the step before it (-1: none)
    warm: bool = False  # one of the first steps of its shape (or it met a new shape of a pass)
    prompted: bool = False  # it spans prompt work (plain decoding pays that alike)


class StepTimer:
    """Times each step from its start to the next one's (a plain step's forward pass runs on while the next step
    starts, so the time between two starts is what a step costs). A step is a sample of its k
    (:meth:`Tuner.record`) only when

    - the steps before and after it have the same k: the step after a change pays part of the one before, and
      a draft that sat out plain steps catches up on them in the first step it proposes;
    - no rows joined or left around it (:meth:`untimed`: the caches are copied by the next step);
    - it is not one of the first ``warm`` steps of its shape (:meth:`shaped`: the k, the rows the caches hold,
      the buffers' widths and whatever else the batch names). On CUDA such a step builds what later ones reuse
      (cuDNN attention graphs, CUDA graphs, kernels compiled at first use), tens of milliseconds paid once: a
      plain step timed while building made plain decoding look slow and speculation look cheap.

    A step that is no sample is charged to its k all the same (:meth:`Tuner.charge`: what tries and looks at
    speculation may lose counts it), as a *steady* one where only rows joining or leaving kept it from being a
    sample (speculation pays that again whenever it runs). A step that spans prompt work is neither."""

    WARM = 2  # steps of a new shape that are no sample (the second: the first's build may spill into it)
    KEPT = 4096  # shapes counted at most (where shapes do not repeat, nearly every step may have its own)

    def __init__(self, tuner: Tuner, warm: int = WARM) -> None:
        self.tuner = tuner
        self.warm = warm
        self._step: _Step | None = None
        self._untimed = 0  # steps from the one being timed on that rows joining or leaving keep from being samples
        self._shapes: dict[Hashable, int] = {}  # steps seen of each (k, shape)

    def start(self, now: float, rows: int, k: int) -> None:
        """A step of ``k`` at ``rows`` rows starts ``now``: the one before it ends."""
        prior = -1
        last = self._step
        if last is not None:
            self._end(last, now, k)
            prior = last.k
        self._untimed = max(0, self._untimed - 1)
        self._step = _Step(rows, k, now, prior)

    def _end(self, step: _Step, now: float, following: int) -> None:
        if step.prompted or not step.rows:
            return
        seconds = now - step.start
        run = step.prior == step.k == following  # a step of a run of the same k
        if run and not step.warm and not self._untimed:
            self.tuner.record(step.rows, step.k, seconds)
        else:
            self.tuner.charge(step.rows, step.k, seconds, steady=run and not step.warm)

    def shaped(self, shape: Hashable) -> None:
        """The step being timed ran in ``shape`` (with its k): one of the first :attr:`warm` steps of it is no
        sample."""
        step = self._step
        if step is None:
            return
        key = (step.k, shape)
        seen = self._shapes.get(key, 0)
        if seen < self.warm and (seen or len(self._shapes) < self.KEPT):
            self._shapes[key] = seen + 1
            step.warm = True

    def built(self) -> None:
        """The step being timed met a new shape of a pass (on CUDA it built a graph): no sample."""
        if self._step is not None:
            self._step.warm = True

    def untimed(self, steps: int = 1) -> None:
        """Rows joined or left: the step being timed, and ``steps - 1`` after it, are no sample."""
        self._untimed = max(self._untimed, steps)

    def prompted(self) -> None:
        """The step being timed spans prompt work: neither a sample nor charged. Nor is the next one a sample: a
        plain step's forward pass ran during the prompt work, so the next step finds it done and looks fast."""
        if self._step is not None:
            self._step.prompted = True
        self.untimed(2)

    def idle(self) -> None:
        """The batch is empty: what follows is idle time, timed by nothing."""
        self._step = None
