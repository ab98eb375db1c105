"""How many bulk requests (``EngineRequest.bulk``) a scheduler step admits beside interactive work.

A step's time is about the tokens it runs (on a CPU, and for a small model anywhere): a decode step one per row, a
prompt step every prompt token it prefills, and mlx-lm's batch prefills up to its prefill batch of prompts in one
step. Bulk rows end every few steps; refilled as they come, eight bulk prompts at once made one step as long as many
decode steps, and an interactive request arriving then waited for all of it before its own start. So while any
interactive request runs, a step admits one bulk request at most (every step stays near a decode step's length, and
the band still refills its rows faster than they end), and none in a step that admits an interactive request (its
prefill goes without bulk prompts beside it). An engine running bulk rows alone admits them as they come.
"""

from __future__ import annotations

import sys

from .sequence import Sequence

__all__ = ["BULK_PER_STEP", "BulkAdmission"]

BULK_PER_STEP = 1  # bulk requests a step admits while interactive ones run


class BulkAdmission:
    """The bulk requests one step may still admit: :meth:`start` it with the step, then ask before each admission."""

    __slots__ = ("_left",)

    def __init__(self) -> None:
        self._left = sys.maxsize

    def start(self, interactive: bool) -> None:
        """A step begins; ``interactive``: an interactive request runs."""
        self._left = BULK_PER_STEP if interactive else sys.maxsize

    def admits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may join in this step (an interactive request always may)."""
        return not seq.req.bulk or self._left > 0

    def admitted(self, seq: Sequence) -> None:
        """``seq`` joined in this step: one bulk admission less, or, an interactive one, none left."""
        self._left = self._left - 1 if seq.req.bulk else 0
