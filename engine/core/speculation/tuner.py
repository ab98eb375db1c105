"""The choice of each speculative step's ``k`` (how many tokens to propose a row): pure Python, from the
acceptance the speculative batch measures and the step times it reports (``engine/mlx/speculation/batch.py``)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Tuner"]


@dataclass(slots=True)
class _Account:
    """What a batch size's steady speculative steps (rows joining and leaving included, a new shape's and a change
    of k's left out) cost, and what plain decoding would have taken to make their tokens: decayed sums."""

    spent: float = 0.0
    worth: float = 0.0
    steps: float = 0.0

    def add(self, spent: float, worth: float, decay: float) -> None:
        self.spent = self.spent * decay + spent
        self.worth = self.worth * decay + worth
        self.steps = self.steps * decay + 1

    def pays(self, least: float) -> bool:
        """Whether speculation made at least as many tokens as plain decoding would have (too few steps: yes)."""
        return self.steps < least or self.worth >= self.spent


@dataclass(slots=True)
class _Looks:
    """When a batch size's tuner next times a k other than its best."""

    every: int  # blocks between two looks
    due: int  # the block of the next look
    blocks: int = 0  # blocks chosen at this size
    best: int = 0
    taken: int = 0  # looks so far


class Tuner:
    """Chooses each step's ``k``: the one with the most tokens per second expected at the batch's size (to the
    nearest power of two), from the acceptance measured over every row (one rate per proposal position, as the
    usual analysis assumes) and the time a step of each ``k`` took at about as many rows, as so many plain steps
    timed lately (plain decoding is timed again when it has no timing within an eighth: on a CPU a row's share of
    a step still shrinks from 24 rows to 32). ``k`` holds for ``block`` steps and only a step that follows one of
    the same ``k`` is timed: a plain step's forward pass runs on while the next step starts, so the step after a
    change pays part of the one before. Every ``k`` is timed first, then the best is used, with plain decoding or
    a neighbour timed again one block in ``explore``. While plain decoding is best, a look at speculation comes in
    twice as many blocks as the last (up to ``explore * SPREAD``): a draft that sat out plain steps must catch up
    on every token since before it proposes again.

    A k is used only while what its steady steps made, those in which rows joined or left included, is at least
    what plain decoding would have made in their time: a k whose timed steps pay while the steps around joins
    cost more is dropped at the next block. Which steps are timed samples (not the first steps of a new shape,
    which build graphs on CUDA) is :class:`~engine.core.speculation.timing.StepTimer`'s to say."""

    TRIES = 3  # timings of each k before the best is trusted
    KEEP = 4  # the latest timings of each k near a row count: their median is its step time (one slow step
    # moves nothing, and two blocks of it replace what a batch long gone measured)
    MARGIN = 1.15  # how much faster than plain decoding a k must look to be used
    SPREAD = 16
    RECENT = 0.9  # the decay per steady speculative step of what they cost and made (about the last 10 count)

    def __init__(self, max_k: int, *, block: int = 4, explore: int = 8, budget: float = 0.01) -> None:
        self.ks = tuple(range(max_k + 1))
        self.block = block
        self.explore = explore
        # The share of the time that tries and looks at a k slower than plain decoding may lose, net of what
        # speculation gained: where a verification costs many plain steps (a device that builds per shape, a
        # compute-bound one), speculation then costs at most that much over a worker's life (its first try aside).
        # Every step of a k counts, those that are no sample of its time too (:meth:`charge`): the first of a
        # block (a draft's catch-up), one after rows joined or left, one that built a new shape (on CUDA).
        self.budget = budget
        self._seconds: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # (size, k) -> (rows, time per row)
        self._kept = 1.0  # proposals kept, and rejected (decayed sums): the acceptance rate is kept / both
        self._rejected = 1.0
        self._k = 0
        self._left = 0  # steps left in the current block
        self._looks: dict[int, _Looks] = {}  # per batch size
        self._accounts: dict[int, _Account] = {}  # per batch size
        self._elapsed = 0.0  # seconds of the steps timed or charged
        self._lost = 0.0  # of them, lost (net) by steps of a k to what plain decoding would have made in that time

    @property
    def acceptance(self) -> float:
        return self._kept / (self._kept + self._rejected)

    def choose(self, rows: int) -> int:
        if self._left <= 0:
            self._k, self._left = self._next(rows), self.block
        self._left -= 1
        return self._k

    def _next(self, rows: int) -> int:
        size = _size(rows)
        for k in self.ks:  # each k timed at this size first (the rest at once where one timed pays: they repay it)
            if len(self._seconds.get((size, k), ())) < self.TRIES:
                paying = self._pays(size) and any(g >= self.MARGIN for g in self._gains(size, rows).values())
                return k if not k or paying or self._affordable() else 0
        if len(self._nearest(size, 0, rows)) < self.TRIES:  # plain decoding is timed at about this many rows
            return 0  # (no catch-up to pay)
        gain = self._gains(size, rows)
        best = max(gain, key=lambda k: gain[k], default=0)
        if best and (gain[best] < self.MARGIN or not self._pays(size)):  # a gain within the timings' noise is
            best = 0  # no gain, nor one that the steps around joins take back
        looks = self._looks.setdefault(size, _Looks(self.explore, due=self.explore))
        looks.blocks += 1
        if best != looks.best:
            looks.best, looks.every, looks.due = best, self.explore, looks.blocks + self.explore
        if looks.blocks < looks.due:
            return best
        # Another k is timed again: plain decoding (what speculation must beat) every other time, else a neighbour.
        looks.due = looks.blocks + looks.every
        if best == 0:  # looking at speculation costs a catch-up; looking at plain decoding costs nothing more
            looks.every = min(looks.every * 2, self.explore * self.SPREAD)
        looks.taken += 1
        neighbours = [k for k in (best - 1, best + 1) if k in self.ks and k not in (0, best)]
        if best and (looks.taken % 2 or not neighbours):
            return 0
        look = neighbours[(looks.taken // 2) % len(neighbours)] if neighbours else best
        return look if look == best or self._affordable() else best

    def _gains(self, size: int, rows: int) -> dict[int, float]:
        """Tokens a step of each k timed at this size makes per plain step's time (plain decoding makes one)."""
        a = self.acceptance
        return {k: sum(a ** j for j in range(k + 1)) / statistics.median(self._nearest(size, k, rows))
                for k in self.ks[1:] if len(self._seconds.get((size, k), ())) >= self.TRIES}

    def _pays(self, size: int) -> bool:
        account = self._accounts.get(size)
        return account is None or account.pays(self.TRIES)

    def _affordable(self) -> bool:
        """Whether a try or look at speculation fits the budget of what such steps may lose."""
        return self._lost <= self.budget * self._elapsed

    def record(self, rows: int, k: int, seconds: float) -> None:
        """A step of ``k`` at ``rows`` rows took ``seconds``: plain decoding's kept per row, so that sizes rounded
        to the same power of two compare (a batch kept full moves between 31 and 32 rows); a proposing k's as so
        many plain steps at about as many rows, timed lately (a machine whose speed drifts moves both alike: a
        plain step timed slow must not make an older timing of a k look fast)."""
        size, cost = _size(rows), seconds / rows
        plain = self.charge(rows, k, seconds, steady=True)
        if k:
            if not plain:
                return
            cost /= plain
        self._seconds.setdefault((size, k), deque(maxlen=4 * self.KEEP)).append((rows, cost))

    def charge(self, rows: int, k: int, seconds: float, steady: bool = False) -> float:
        """A step of ``k`` at ``rows`` rows took ``seconds``, counted in what tries and looks at speculation may
        lose; on its own, a step that is no sample of its k's time (the first of a block, which pays the draft's
        catch-up; one after rows joined or left; one that built a new shape): what it cost is charged, never
        taken for what the k costs. ``steady``: a step of a run of its k, no new shape's (rows joining or leaving
        kept it from being a sample), which also counts in whether the k pays as it runs. Returns plain
        decoding's time per row it was measured against (0: none)."""
        self._elapsed += seconds
        if not k:
            return 0.0
        size = _size(rows)
        per_row = self._plain(size, rows)
        if not per_row:
            return 0.0
        # The time this step took beyond what plain decoding would take to make as many tokens (less: a gain,
        # which pays for later looks: what speculation loses is bounded over the run, not look by look).
        worth = sum(self.acceptance ** j for j in range(k + 1)) * rows * per_row
        self._lost += seconds - worth
        if steady:
            self._accounts.setdefault(size, _Account()).add(seconds, worth, self.RECENT)
        return per_row

    def _plain(self, size: int, rows: int) -> float:
        """Plain decoding's time per row at about ``rows`` lately, those nearest in rows where none is near (0:
        none). The median, as a k's: a machine slowed by other work slows both alike, so what a k costs in plain
        steps holds, and what speculation spent is weighed against what plain decoding spends as it runs."""
        plain = self._nearest(size, 0, rows) or self._ranked(size, 0, rows)
        return statistics.median(plain) if plain else 0.0

    def _nearest(self, size: int, k: int, rows: int) -> list[float]:
        """Timings of ``k``: plain decoding's the latest at about ``rows`` rows (within an eighth, or one); a
        proposing k's the ``KEEP`` taken nearest ``rows`` (timing one again costs the draft a catch-up)."""
        if k:
            return self._ranked(size, k, rows)
        samples = self._seconds.get((size, k), ())
        return [t for r, t in samples if abs(r - rows) <= max(1, rows // 8)][-self.KEEP:]

    def _ranked(self, size: int, k: int, rows: int) -> list[float]:
        """The ``KEEP`` timings of ``k`` taken nearest ``rows`` rows, the latest first among equals."""
        samples = list(self._seconds.get((size, k), ()))
        ranked = sorted(range(len(samples)), key=lambda i: (abs(samples[i][0] - rows), -i))
        return [samples[i][1] for i in ranked[:self.KEEP]]

    def accepted(self, kept: Sequence[int], k: int) -> None:
        """Rows kept ``kept[i]`` of ``k`` proposals: each kept one a success, the first rejected a failure."""
        decay = 0.98  # recent steps count most: acceptance moves with what the batch generates
        self._kept = self._kept * decay + sum(kept)
        self._rejected = self._rejected * decay + sum(1 for a in kept if a < k)


def _size(rows: int) -> int:
    """The power of two nearest ``rows`` (its exponent): batch sizes whose steps are timed together."""
    return round(math.log2(rows)) if rows > 0 else 0
