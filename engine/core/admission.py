"""KV admission: whether a sequence can join the batch, by sequence slots and KV bytes.

With a :class:`~engine.core.memory.KVBudget`, every running row is charged as long as the longest row may grow
(a batch pads its rows to the longest: ``memory.py``), the caches of preempted sequences parked for their
resume are charged too, and so is any excess of the caches' measured bytes over that estimate, so a wrong
estimate cannot run away. Without one, only slots count. :class:`KVAdmission` owns that accounting (rows and
their ends, parked bytes, the last measurement) and answers the scheduler's questions: does it fit, with
these victims gone, parking these caches; could it ever fit; how many typical requests still fit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .memory import KVBudget, mib
from .stats import EngineStats

__all__ = ["KVAdmission", "Parked", "Row"]


class Row(Protocol):
    """What admission reads of a sequence."""

    @property
    def end(self) -> int: ...  # the most tokens its cache can hold (prompt + max_tokens)
    @property
    def length(self) -> int: ...  # tokens in its cache now
    @property
    def parked_bytes(self) -> int: ...  # its cache parked while preempted (0: none)


class Parked(Protocol):
    """A waiting sequence that may have parked its cache (preempted, to resume from it)."""

    parked: Any  # its cache (None: none parked)
    parked_bytes: int


class KVAdmission:
    """Slots and KV bytes of one batch of at most ``capacity`` rows (``budget`` None: slots only)."""

    def __init__(self, capacity: int, budget: KVBudget | None, stats: EngineStats,
                 context_length: int | None = None) -> None:
        self.capacity = capacity
        self.budget = budget
        self.context_length = context_length
        self.stats = stats
        stats.kv_headroom_bytes = budget.headroom if budget is not None else 0
        self.rows = 0
        self.parked = 0  # bytes of caches parked by preempted sequences
        self._ends: Counter[int] = Counter()  # running rows by their end
        self._longest: int | None = 0  # the largest end running (None: to recompute)
        self._probe: Callable[[], int] | None = None
        self._measured = 0  # the batch's KV bytes at the last reading
        self._stale = True

    # --- the batch changes ---------------------------------------------------------------------------
    def use(self, probe: Callable[[], int] | None) -> None:
        """Measure a (new) batch's KV bytes with ``probe`` (None: a backend that cannot say)."""
        self._probe = probe
        self._stale = True

    def join(self, row: Row) -> None:
        self.rows += 1
        self._ends[row.end] += 1
        if self._longest is not None and row.end > self._longest:
            self._longest = row.end
        self._stale = True

    def leave(self, row: Row) -> None:
        self.rows -= 1
        left = self._ends[row.end] - 1
        if left:
            self._ends[row.end] = left
        else:
            del self._ends[row.end]
        if self._longest is not None and row.end >= self._longest:
            self._longest = None
        self._stale = True

    def park(self, nbytes: int) -> None:
        self.parked += nbytes

    def unpark(self, seq: Parked) -> Any:
        """Take a waiting sequence's parked cache from it (to resume from, or dropped; the last reading no longer
        counts it); None if it has none."""
        cache, nbytes = seq.parked, seq.parked_bytes
        if cache is not None:
            self.parked -= nbytes
            self.stats.kv_bytes = max(0, self.stats.kv_bytes - nbytes)
            seq.parked, seq.parked_bytes = None, 0
            self.reserve()
        return cache

    def clear(self) -> None:
        """Nothing runs or is parked (after an engine failure); the failed batch is not asked again."""
        self.rows, self.parked, self._longest, self._measured, self._stale = 0, 0, 0, 0, False
        self._ends.clear()
        self.stats.kv_bytes = self.stats.kv_reserved_bytes = 0

    def read(self) -> None:
        """Read the batch's KV bytes (on the engine thread, after every step and removal: never stale)."""
        if self._probe is None:
            return
        self._measured, self._stale = self._probe(), False
        used = self._measured + self.parked
        self.stats.kv_bytes = used
        if used > self.stats.kv_bytes_peak:
            self.stats.kv_bytes_peak = used

    def reserve(self) -> None:
        """Publish the admission estimate (what the admitted rows may grow to, and the parked caches)."""
        if self.budget is not None:
            self.stats.kv_reserved_bytes = self.budget.batch_bytes(self.rows, self.longest()) + self.parked

    # --- questions -----------------------------------------------------------------------------------
    def never_fits(self, prompt: int, max_tokens: int) -> str | None:
        """Why a request can never run here (beyond the context, or its KV alone beyond the headroom)."""
        p, m, ctx = prompt, max_tokens, self.context_length
        if ctx is not None and p + m > ctx:
            return f"prompt ({p} tokens) + max_tokens ({m}) exceeds the context ({ctx}) by {p + m - ctx} tokens"
        if self.budget is not None:
            need, room = self.budget.batch_bytes(1, p + m), self.budget.headroom
            if need > room:
                return (f"prompt ({p} tokens) + max_tokens ({m}) needs {mib(need)} of KV cache, {mib(need - room)} "
                        f"more than this worker's KV headroom ({mib(room)})")
        return None

    def fits(self, row: Row, victims: Sequence[Row] = (), *, park: bool = False, slots: bool = True,
             drop_parked: bool = False) -> bool:
        """Whether ``row`` can join once ``victims`` left (parking their caches if ``park``); ``slots=False``:
        whether the KV headroom has room for it beside every running row, whatever the slots;
        ``drop_parked``: whether it could once the other parked caches were dropped."""
        rows = self.rows - len(victims)
        if slots and rows >= self.capacity:
            return False
        budget = self.budget
        if budget is None:
            return True
        longest = max(row.end, self.longest(victims))
        parked = 0 if drop_parked else self.parked - row.parked_bytes
        if park:
            parked += sum(budget.layout.cache_bytes(v.length) for v in victims)
        return budget.batch_bytes(rows + 1, longest) + parked + self.excess() <= budget.headroom

    def kv_rows(self, typical: int) -> int:
        """How many more requests of ``typical`` tokens the headroom has room for beside the running ones."""
        if self.budget is None:
            return self.capacity - self.rows
        fit = self.budget.rows_that_fit(max(self.longest(), typical), self.parked + self.excess())
        # An idle engine takes one whatever the estimate says: alone, a request either fits or is refused
        # with a clear error, and a worker that claims nothing serves nobody.
        return max(fit - self.rows, 1 if self.rows == 0 else 0)

    def longest(self, without: Sequence[Row] = ()) -> int:
        """The largest end among the running rows (less ``without``)."""
        if without:
            gone = Counter(v.end for v in without)
            return max((end for end, n in self._ends.items() if n > gone[end]), default=0)
        if self._longest is None:
            self._longest = max(self._ends, default=0)
        return self._longest

    def excess(self) -> int:
        """How far the caches' measured bytes exceed the estimate for the running rows (0 normally)."""
        if self.budget is None or self._probe is None:
            return 0
        if self._stale:  # the batch changed since the last step: never judge by a stale figure
            self._measured, self._stale = self._probe(), False
        return max(0, self._measured - self.budget.batch_bytes(self.rows, self.longest()))
