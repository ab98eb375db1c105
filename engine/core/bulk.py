"""How many bulk requests (``EngineRequest.bulk``) a scheduler step admits beside interactive work.

A step's time is about the tokens it runs (on a CPU, and for a small model anywhere): a decode step one per row, a
prompt step every prompt token it prefills, and mlx-lm's batch prefills up to its prefill batch of prompts in one
step. Bulk rows end every few steps; refilled as they come, eight bulk prompts at once made one step as long as many
decode steps, and an interactive request arriving then waited for all of it before its own start. So while any
interactive request runs, a step admits one bulk request at most (every step stays near a decode step's length, and
the band still refills its rows faster than they end), and none in a step that admits an interactive request (its
prefill goes without bulk prompts beside it).

The same holds for ``hold_s`` after the last interactive row ends: clients send their next requests as their last
ones end (a stream, an agent's calls), and those arrive a few milliseconds later. When bulk rows end in that
same step (equal lengths started in step end together every cycle), their refill, admitted as it came, prefilled a
whole slot's worth of bulk prompts in the very step the next interactive requests waited for. An engine that has run
bulk rows alone for longer admits them as they come. The hold is ``REFILL_HOLD_S`` at most (less when the
worker's ``MLXQ_BULK_HOLD_MS`` is): the next requests come within milliseconds or not soon, and each held second is a
second of the batch's rows refilled one a step.
"""

from __future__ import annotations

import sys

from .sequence import Sequence

__all__ = ["BULK_PER_STEP", "REFILL_HOLD_S", "BulkAdmission"]

BULK_PER_STEP = 1  # bulk requests a step admits while interactive ones run (or ran within hold_s)
REFILL_HOLD_S = 1.0  # the longest a step holds bulk admissions so after the last interactive row


class BulkAdmission:
    """The bulk requests one step may still admit: :meth:`start` it with the step, then ask before each admission.
    ``hold_s``: how long after the last interactive row a step still admits as if one ran (``REFILL_HOLD_S`` at
    most)."""

    __slots__ = ("_interactive_at", "_left", "hold_s")

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = min(hold_s, REFILL_HOLD_S)
        self._left = sys.maxsize
        self._interactive_at = -float("inf")  # when a step last began with an interactive row running

    def start(self, interactive: bool, now: float) -> None:
        """A step begins at ``now``; ``interactive``: an interactive request runs."""
        if interactive:
            self._interactive_at = now
        recent = now - self._interactive_at < self.hold_s
        self._left = BULK_PER_STEP if interactive or recent else sys.maxsize

    def admits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may join in this step (an interactive request always may)."""
        return not seq.req.bulk or self._left > 0

    def admitted(self, seq: Sequence) -> None:
        """``seq`` joined in this step: one bulk admission less, or, an interactive one, none left."""
        self._left = self._left - 1 if seq.req.bulk else 0
