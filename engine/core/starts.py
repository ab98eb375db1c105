"""Which waiting requests start at once, and which of them start together.

A request starts at once when it is new and of higher priority than some running sequence, or of a group below its
share (taking another group's place, or a free slot beside a group above its share): it is prefilled on its own
before the next decode step, its first token sampled from that prefill (in mlx-lm's batch a joining prompt waits for
three decode steps of the whole batch, and is prefilled with the others joining then: a light tenant's job would
wait for a flood's refill of the batch, an interactive job for a step of every bulk row).

Requests that start at once in the same step start together: clients that send their next requests as their last
ones end (streams, a conversation's turns) send them together, and each prefilled alone, the last one's first token
waited for every other one's prefill; prefilled in one batch (the backend's ``start_many``) they all cost about one.
"""

from __future__ import annotations

from .preemption import Preemption
from .running import Running
from .sequence import Sequence
from .shares import Shares
from .waiting import WaitingQueue

__all__ = ["starts_at_once", "together"]


def starts_at_once(seq: Sequence, plan: Preemption | None, running: Running, shares: Shares) -> bool:
    """Whether ``seq`` starts at once (with a backend that can start a request so), given its preemption ``plan``."""
    if seq.admitted or seq.req.images is not None:
        return False
    lowest = running.lowest_priority
    return (lowest is not None and lowest < seq.req.priority) or (plan is not None and plan.across) or \
        shares.below(seq.req)


def together(waiting: WaitingQueue[Sequence], running: Running, shares: Shares, free: int) -> list[Sequence]:
    """The waiting requests that will start at once in this step into free slots (``free`` of them), in the order
    they leave the queue: the head and those after it that do too; [] unless there are two at least."""
    head = waiting.peek()
    if head is None or free < 2 or not starts_at_once(head, None, running, shares):
        return []
    out: list[Sequence] = []
    for seq in sorted(waiting, key=lambda s: (s.key, s.order)):
        if len(out) == free or seq.req.bulk or not starts_at_once(seq, None, running, shares):
            break
        out.append(seq)
    return out if len(out) > 1 else []
