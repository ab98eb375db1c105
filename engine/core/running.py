"""The batch's running sequences: by row (the backend's uid) and by request id, counted per priority and per
group (:class:`~engine.core.shares.Shares`), so the scheduler asks "who runs, at which priorities, in which
groups" of one object and keeps the counts in step with the rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from .sequence import Sequence
from .shares import Shares

__all__ = ["Running"]


class Running:
    """The running sequences, and their counts per priority and per group (``shares``, which also counts the
    waiting requests' groups: the scheduler's own)."""

    __slots__ = ("_by_uid", "_uid_of", "bulk", "priorities", "shares")

    def __init__(self, shares: Shares) -> None:
        self._by_uid: dict[int, Sequence] = {}
        self._uid_of: dict[str, int] = {}
        self.priorities: Counter[int] = Counter()  # running sequences per priority
        self.bulk = 0  # running sequences of the bulk band (``EngineRequest.bulk``)
        self.shares = shares

    def __len__(self) -> int:
        return len(self._by_uid)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._by_uid.values())

    def get(self, uid: int) -> Sequence | None:
        """The sequence in row ``uid``; None when the row has left since."""
        return self._by_uid.get(uid)

    def has(self, rid: str) -> bool:
        return rid in self._uid_of

    @property
    def lowest_priority(self) -> int | None:
        return min(self.priorities, default=None)

    def add(self, seq: Sequence) -> None:
        """``seq`` runs in row ``seq.uid``."""
        self._by_uid[seq.uid] = seq
        self._uid_of[seq.rid] = seq.uid
        self.priorities[seq.req.priority] += 1
        self.bulk += seq.req.bulk
        self.shares.join(seq.req)

    def pop(self, rid: str) -> Sequence | None:
        """Take request ``rid``'s sequence out; None if it is not running."""
        uid = self._uid_of.pop(rid, None)
        seq = self._by_uid.pop(uid, None) if uid is not None else None
        if seq is None:
            return None
        left = self.priorities[seq.req.priority] - 1
        if left:
            self.priorities[seq.req.priority] = left
        else:
            del self.priorities[seq.req.priority]
        self.bulk -= seq.req.bulk
        self.shares.leave(seq.req)
        return seq

    def clear(self) -> None:
        """Forget every running sequence (the shares' waiting counts too: the scheduler clears its queue)."""
        self._by_uid.clear()
        self._uid_of.clear()
        self.priorities.clear()
        self.bulk = 0
        self.shares.clear()
