"""The speculative batch's choice of k (engine/core/speculation/tuner.py): pure Python, driven by made-up step times and
acceptances (no MLX)."""

from __future__ import annotations

import itertools
import random

import pytest

from mlxq.engine.core.speculation.tuner import Tuner

pytestmark = pytest.mark.unit


def test_the_tuner_tries_every_k_then_keeps_the_fastest_and_looks_around_it() -> None:
    tuner = Tuner(3, block=4, explore=4)
    step_s = {0: 1.0, 1: 1.2, 2: 1.4, 3: 2.2}  # a step's time at each k; a proposal is kept 3 times in 4
    chosen = []
    for _ in range(240):
        k = tuner.choose(8)
        chosen.append(k)
        tuner.record(8, k, step_s[k])
        if k:
            tuner.accepted([min(k, a) for a in (0, 1, 3, 5, 9, 9, 9, 9)], k)
    blocks = [chosen[i:i + 4] for i in range(0, 240, 4)]
    assert all(len(set(b)) == 1 for b in blocks)  # k holds for a block
    assert [b[0] for b in blocks[:4]] == [0, 1, 2, 3]  # each k timed first
    # expected tokens per second: k=1 (1 + a) / 1.2, k=2 (1 + a + a^2) / 1.4 (the best), k=3 ... / 2.2
    later = [b[0] for b in blocks[4:]]
    looks = [i for i, k in enumerate(later) if k != 2]
    assert {later[i] for i in looks} == {0, 1, 3}  # plain decoding and the neighbours timed again
    assert {b - a for a, b in itertools.pairwise(looks)} == {4}  # every few blocks: a plain block costs no catch-up
    assert 0.6 < tuner.acceptance < 0.9
    assert Tuner(3).choose(32) == 0  # a batch size not timed yet starts from the start


def test_while_plain_decoding_is_best_the_tuner_looks_at_speculation_less_and_less() -> None:
    slow = Tuner(2, block=4, explore=4, budget=1.0)  # proposals never kept: plain decoding wins (the schedule
    # of looks alone: the budget of what they may lose is the test after the next)
    chosen = []
    for _ in range(600):
        k = slow.choose(4)
        chosen.append(k)
        slow.record(4, k, 1.0 + 0.3 * k)
        if k:
            slow.accepted([0, 0, 0, 0], k)
    later = [b[0] for b in [chosen[i:i + 4] for i in range(0, 600, 4)][3:]]
    looks = [i for i, k in enumerate(later) if k]
    assert [later[i] for i in looks] == [1] * len(looks)  # the neighbour of plain decoding
    # a draft that sat out plain steps catches up on all of them when it proposes: each look costs that
    assert [b - a for a, b in itertools.pairwise(looks)] == [4, 8, 16, 32, 64]
    assert slow.choose(4) == 0


def test_the_tuner_compares_timings_taken_at_about_as_many_rows() -> None:
    tuner = Tuner(1, block=4, explore=4)
    per_row = {24: {0: 2.5, 1: 3.0}, 32: {0: 1.9, 1: 3.0}}  # ms per row: plain's share shrinks as rows grow

    def steps(rows: int, n: int) -> list[int]:
        chosen = []
        for _ in range(n):
            k = tuner.choose(rows)
            chosen.append(k)
            tuner.record(rows, k, per_row[rows][k] * rows / 1000)
            if k:
                tuner.accepted([1] * 3 + [0], k)  # kept 3 times in 4: k = 1 yields 1.75 tokens a step
        return chosen

    assert steps(24, 40)[-4:] == [1] * 4  # 1.75 / 3.0 against 1 / 2.5: speculation pays at 24 rows
    at_32 = steps(32, 40)
    assert at_32[:4] == [0] * 4  # plain decoding's timing at 24 rows is no timing at 32: it is taken again
    assert at_32[4:].count(0) >= 28  # 1.75 / 3.0 against 1 / 1.9: plain decoding, but for a look or two


def test_a_machine_slowing_down_does_not_make_speculation_look_faster() -> None:
    # Steps of every k slow alike as the machine drifts (here up to 1.3x). At a = 0.8, k = 2 makes 2.44 tokens
    # in 2.3 plain steps' time: no gain worth it. Timed as so many plain steps, that holds however plain
    # decoding's latest timing moved; an older k = 2 timing against a plain one taken slow made k = 2 look up to
    # 1.38x faster than plain decoding, and the tuner speculated at a loss.
    tuner = Tuner(2, block=4, explore=4, budget=1.0)  # the schedule of looks alone
    cost = {0: 60.0, 1: 105.0, 2: 138.0}  # ms per step at rows 32
    kept = {1: [1] * 13 + [0] * 3, 2: [2] * 10 + [1] * 3 + [0] * 3}  # a = 0.81 and 0.79
    chosen = []
    for step in range(800):
        k = tuner.choose(32)
        chosen.append(k)
        drift = 1.0 + 0.3 * min(1.0, step / 400)
        tuner.record(32, k, cost[k] * drift / 1000)
        if k:
            tuner.accepted(kept[k], k)
    later = [b[0] for b in [chosen[i:i + 4] for i in range(0, 800, 4)][3:]]  # after each k's first timings
    looks = [i for i, k in enumerate(later) if k]
    assert [b - a for a, b in itertools.pairwise(looks)] == [4, 8, 16, 32, 64, 64]  # only the looks at speculation


class Batch:
    """Steps timed as the speculative batch times them (engine/mlx/speculation/batch.py): a step is a sample of its k
    when the steps before and after it have the same k and nothing made it untimed (rows joined or left, a new
    shape); every other step is charged to its k (``charged=False``: left out, as before steps were charged)."""

    def __init__(self, tuner: Tuner, charged: bool = True) -> None:
        self.tuner, self.charged = tuner, charged
        self.last: tuple[int, int, float, bool] | None = None  # rows, k, seconds, untimed
        self.prior = -1

    def step(self, rows: int, k: int, seconds: float, untimed: bool = False) -> None:
        """Time the step before this one (of ``k``) now that this one's k is known."""
        if self.last is not None:
            r, last, s, off = self.last
            if not off and last == k == self.prior:
                self.tuner.record(r, last, s)
            elif self.charged:
                self.tuner.charge(r, last, s)
            self.prior = last
        self.last = (rows, k, seconds, untimed)


def loaded(tuner: Tuner, steps: int, verify: float, build: float, seed: int, charged: bool = True) -> float:
    """Tokens made over what plain decoding makes in the same time (at the same rows), on a simulated batch whose
    steps cost a plain step each, a verification ``verify`` plain steps (+ 0.1 a proposal), and the first step of
    each new shape (rows held, k, buffer) ``build`` more; rows join and leave (5 to 8), buffers come and go."""
    rng = random.Random(seed)
    batch, shapes = Batch(tuner, charged), set()
    rows, a, made, plain = 8, 0.7, 0.0, 0.0
    for step in range(steps):
        moved = rng.random() < 0.08  # a row ended or joined: this step copies the caches
        rows = rng.randint(5, 8) if moved else rows
        k = tuner.choose(rows)
        shape = (1 << (rows - 1).bit_length(), k, (step // 1500) % 5)  # buckets of rows, whole buffers
        new = bool(k) and shape not in shapes
        shapes.add(shape)
        seconds = (1.0 if k == 0 else verify + 0.1 * k) * rng.uniform(0.97, 1.03) + (build if new else 0.0)
        kept = [next((j for j in range(k) if rng.random() >= a), k) for _ in range(rows)] if k else []
        if k:
            tuner.accepted(kept, k)
        batch.step(rows, k, seconds, untimed=moved or new)
        made += rows + sum(kept)
        plain += rows * seconds
    return made / plain


@pytest.mark.parametrize("verify", [15.0, 3.0])
def test_tries_and_looks_at_speculation_that_costs_many_plain_steps_lose_at_most_the_budget(verify: float) -> None:
    # On a device where a verification costs many plain steps (MLX's CUDA backend building an attention graph per
    # shape made it ~15), speculation never pays; the tuner must still time it, and over a worker's run its tries
    # and looks may lose at most its budget (1 %) beside the first try.
    rng = random.Random(0)
    tuner, rows, a = Tuner(4), 8, 0.7
    batch = Batch(tuner)
    elapsed = made = 0.0
    for _ in range(20_000):
        k = tuner.choose(rows)
        seconds = (1.0 if k == 0 else verify + 0.1 * k) * rng.uniform(0.97, 1.03)  # in plain steps
        kept = [next((j for j in range(k) if rng.random() >= a), k) for _ in range(rows)] if k else []
        if k:
            tuner.accepted(kept, k)
        batch.step(rows, k, seconds)
        elapsed += seconds
        made += rows + sum(kept)
    assert made / elapsed / rows >= 0.98  # of plain decoding's tokens per plain step
    if verify < 15:
        return
    untuned = Tuner(4, budget=1.0)  # without the budget the looks alone cost more (11 % here)
    batch, elapsed, made = Batch(untuned), 0.0, 0.0
    for _ in range(20_000):
        k = untuned.choose(rows)
        seconds = 1.0 if k == 0 else verify + 0.1 * k
        batch.step(rows, k, seconds)
        if k:
            untuned.accepted([0] * rows, k)
        elapsed, made = elapsed + seconds, made + rows
    assert made / elapsed / rows < 0.98


@pytest.mark.parametrize("verify", [15.0, 1.3])
def test_steps_that_build_a_new_shape_are_charged_and_keep_the_budget(verify: float) -> None:
    # On CUDA each new shape of a verification builds a cuDNN graph (~50 ms, here 50 plain steps), in a step that
    # is no sample of its k's time (the first of a block, or one after rows joined). Charged to the k all the same,
    # the tries and looks that build keep within the budget, where speculation never pays (15) and where it does
    # (1.3: its gains pay for later looks, so a run long enough to repay the builds speculates).
    assert loaded(Tuner(4), 20_000, verify, build=50.0, seed=1) >= 0.98
    if verify < 15:
        assert loaded(Tuner(4), 20_000, verify, build=15.0, seed=1) > 1.2
        return
    # Left out of the tuner's account, the builds of its tries and looks cost more than the budget
    assert loaded(Tuner(4), 20_000, verify, build=50.0, seed=1, charged=False) < 0.98
