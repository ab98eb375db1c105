"""The speculative batch's choice of k (engine/core/speculation/tuner.py) and which of its steps time their k
(engine/core/speculation/timing.py): pure Python, driven by made-up step times and acceptances (no MLX)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable
from dataclasses import dataclass

import pytest

from mlxq.engine.core.speculation.timing import StepTimer
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


class SamplesOnly:
    """A tuner behind a :class:`StepTimer` that is told of its samples only (as before steps were charged)."""

    def __init__(self, tuner: Tuner) -> None:
        self.tuner = tuner

    def record(self, rows: int, k: int, seconds: float) -> None:
        self.tuner.record(rows, k, seconds)

    def charge(self, rows: int, k: int, seconds: float, steady: bool = False) -> float:
        return 0.0


class Batch:
    """Steps timed as the speculative batch times them (engine/mlx/speculation/batch.py), by its
    :class:`StepTimer` on a clock of made-up step times (``charged=False``: only samples reach the tuner)."""

    def __init__(self, tuner: Tuner, charged: bool = True, warm: int = StepTimer.WARM) -> None:
        self.timer = StepTimer(tuner if charged else SamplesOnly(tuner), warm)  # type: ignore[arg-type]
        self.now = 0.0

    def step(self, rows: int, k: int, seconds: float, untimed: bool = False, shape: Hashable = None) -> None:
        """A step of ``k`` that takes ``seconds``; ``untimed``: rows joined or left in it; ``shape``: what the
        batch names its shape."""
        self.timer.start(self.now, rows, k)
        if untimed:
            self.timer.untimed(2)
        self.timer.shaped(shape)
        self.now += seconds


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
        batch.step(rows, k, seconds, untimed=moved, shape=shape)
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


class Ledger:
    """A tuner's stand-in behind a :class:`StepTimer`: which steps it was told of as samples, which as charges."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, float]] = []  # k, seconds
        self.charged: list[tuple[int, float, bool]] = []  # k, seconds, steady

    def record(self, rows: int, k: int, seconds: float) -> None:
        self.samples.append((k, seconds))

    def charge(self, rows: int, k: int, seconds: float, steady: bool = False) -> float:
        self.charged.append((k, seconds, steady))
        return 0.0


def test_the_first_steps_of_each_new_shape_are_no_sample_but_are_charged() -> None:
    # On CUDA the first steps of a new shape build graphs and compile kernels, paid once: timed as samples, a plain
    # step that built made plain decoding look slow and speculation cheap. Each step here takes its index in
    # seconds, so what the tuner was told names the steps.
    ledger = Ledger()
    batch = Batch(ledger)  # type: ignore[arg-type]
    script = [(0, "A")] * 6 + [(0, "B")] * 5 + [(2, "A")] * 5 + [(0, "A")] * 4 + [(0, "C")]
    for i, (k, shape) in enumerate(script):
        batch.step(8, k, float(i), shape=shape)
    # 0: the first (no step before it); 1, 6-7, 11-12: the first two of (0, A), (0, B), (2, A); 10, 15: the last
    # before a change of k, 11 and 16 the first after one. (0, A) again at 16 is no new shape: 17 on are samples.
    assert ledger.samples == [(0, 2.0), (0, 3.0), (0, 4.0), (0, 5.0), (0, 8.0), (0, 9.0), (2, 13.0), (2, 14.0),
                              (0, 17.0), (0, 18.0), (0, 19.0)]
    assert [(k, s) for k, s, _ in ledger.charged] == [(0, 0.0), (0, 1.0), (0, 6.0), (0, 7.0), (0, 10.0), (2, 11.0),
                                                      (2, 12.0), (2, 15.0), (0, 16.0)]
    assert not any(steady for *_, steady in ledger.charged)  # warm-ups and changes of k are no steady steps


def test_steps_around_rows_joining_are_no_sample_but_steady_and_prompt_work_is_neither() -> None:
    ledger = Ledger()
    batch = Batch(ledger)  # type: ignore[arg-type]
    for i in range(12):
        batch.step(8, 2, float(i), untimed=i == 4, shape="A")
        if i == 8:
            batch.timer.prompted()  # this step spans prompt work; the next one finds its pass done during it
    assert [s for _, s in ledger.samples] == [2.0, 3.0, 6.0, 7.0, 10.0]
    assert [(s, steady) for _, s, steady in ledger.charged] == [(0.0, False), (1.0, False), (4.0, True),
                                                               (5.0, True), (9.0, True)]


@dataclass
class Device:
    """A simulated batch's step times, in plain steps: a plain step costs 1, a speculative one of k ``verify`` +
    0.1 k; ``a``: the acceptance of each proposal."""

    verify: float
    a: float = 0.7
    joins: float = 0.08  # the chance that a row joins or leaves at a step (the rows: 7 or 8)
    join_cost: float = 0.0  # what such a step costs more when it speculates (the draft's caches copied too)
    build: tuple[float, ...] = ()  # what the first steps of each new shape cost more (graphs built once)
    noise: float = 0.0  # the chance that a burst of slow steps (2-3x, 5 to 40 of them) starts: a loaded machine
    buffer: int = 1500  # steps per cache buffer (a new shape, for every k)


def simulate(tuner: Tuner, device: Device, steps: int, seed: int,
             batch: Batch | None = None) -> tuple[float, list[int]]:
    """Tokens made over what plain decoding makes in the same time (the same slowdowns; its own builds its own),
    and each step's k; ``batch``: one that went on before."""
    rng = random.Random(seed)
    batch, seen = batch or Batch(tuner), dict[tuple[int, int], int]()
    rows, spent, worth, slow, burst, chosen = 8, 0.0, 0.0, 1.0, 0, []
    for step in range(steps):
        moved = rng.random() < device.joins
        rows = rng.choice([7, 8]) if moved else rows
        k = tuner.choose(rows)
        chosen.append(k)
        shape = (k, step // device.buffer)
        n = seen[shape] = seen.get(shape, 0) + 1
        built = device.build[n - 1] if n <= len(device.build) else 0.0
        if burst <= 0 and rng.random() < device.noise:
            burst, slow = rng.randint(5, 40), rng.uniform(2.0, 3.0)
        burst -= 1
        unit = slow if burst > 0 else 1.0
        seconds = unit * (1.0 if not k else device.verify + 0.1 * k + (device.join_cost if moved else 0.0)) + built
        kept = [next((j for j in range(k) if rng.random() >= device.a), k) for _ in range(rows)] if k else []
        if k:
            tuner.accepted(kept, k)
        batch.step(rows, k, seconds, untimed=moved, shape=shape[1])
        spent += seconds
        worth += (rows + sum(kept)) / rows * unit + (built if not k else 0.0)
    return worth / spent, chosen


SLOWER = {"dear verification": Device(verify=2.0, a=0.6),
          "builds": Device(verify=1.8, a=0.6, build=(30.0, 10.0, 3.0), buffer=300),
          "loaded machine": Device(verify=1.9, a=0.6, noise=0.03),
          "both": Device(verify=1.9, a=0.6, build=(30.0, 10.0, 3.0), buffer=300, noise=0.03)}


@pytest.mark.parametrize("name", list(SLOWER))
def test_speculation_that_costs_more_than_it_gains_settles_on_plain_decoding(name: str) -> None:
    # Fully loaded: speculation at best breaks even, whatever the k. Neither the first steps of each new shape
    # (plain decoding's and each k's, timed slow while they build) nor bursts of slow steps (a loaded machine:
    # noise only ever slows a step) may make it look worth using: past its first tries the tuner decodes plainly
    # but for looks, and makes as many tokens as plain decoding would (never slower).
    for seed in range(3):
        ratio, chosen = simulate(Tuner(4), SLOWER[name], 12_000, seed)
        assert sum(1 for k in chosen[2000:] if k) <= 0.03 * len(chosen[2000:]), (seed, ratio)
        assert ratio >= 0.97, seed


def test_speculation_whose_steps_around_joins_cost_more_than_its_timed_steps_gain_is_dropped() -> None:
    # Its timed steps make 1.6x plain decoding's tokens, but a step in which rows joined or left (no sample: the
    # caches are copied) costs 4 plain steps more when it speculates (the draft's caches too), and rows join or
    # leave often: speculating makes fewer tokens than plain decoding. What the steady steps made decides.
    device = Device(verify=1.3, a=0.8, joins=0.3, join_cost=4.0)
    ratio, chosen = simulate(Tuner(4), device, 8000, seed=2)
    assert sum(1 for k in chosen[2000:] if k) <= 0.05 * len(chosen[2000:])
    assert ratio >= 0.97
    paying, chosen = simulate(Tuner(4), Device(verify=1.3, a=0.8, joins=0.3, join_cost=0.2), 8000, seed=2)
    assert paying > 1.3 and sum(1 for k in chosen[2000:] if k) > 0.9 * len(chosen[2000:])  # where they pay: used


def test_speculation_that_stops_paying_is_dropped_within_a_few_blocks() -> None:
    tuner, device = Tuner(4), Device(verify=1.2, a=0.8, buffer=10_000)
    batch = Batch(tuner)
    _, before = simulate(tuner, device, 3000, seed=4, batch=batch)
    assert sum(1 for k in before[-400:] if k) >= 360  # it paid: used (but for looks at plain decoding)
    device.verify = 4.0  # now every verification costs 4 plain steps
    _, after = simulate(tuner, device, 2000, seed=5, batch=batch)
    assert after[24:32].count(0) == 8  # plain decoding within six blocks of four steps
    assert sum(1 for k in after[100:] if k) <= 0.03 * len(after[100:])
