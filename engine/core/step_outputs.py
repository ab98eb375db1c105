"""One scheduler step's outputs: a record per request, each row's tokens written into its request's record.

A request's tokens go into its record in ``deferred`` (the engine's pacer's, still unsent) when it has one, so a
paced request's tokens accumulate in place. The tokens whose log-probabilities are asked for are gathered for
the backend to read in one batched call at the step's end (``BatchBackend.attach_logprobs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .backend import GeneratedToken, LogprobsAsked
from .request import ErrorCode, FinishReason, RequestOutput
from .sequence import Sequence

__all__ = ["StepFailed", "StepOutputs"]


class StepFailed(Exception):
    """The batch failed mid-step; ``outputs`` are what the step had already decided (emit them first)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__(f"step failed after {len(outputs)} outputs")
        self.outputs = outputs


@dataclass(slots=True)
class StepOutputs:
    """Outputs of one step, one record per request; the tokens whose log-probabilities are asked for."""

    deferred: Mapping[str, RequestOutput]
    by_rid: dict[str, RequestOutput] = field(default_factory=dict)
    logprobs: list[LogprobsAsked] = field(default_factory=list)

    def get(self, rid: str) -> RequestOutput:
        out = self.by_rid.get(rid)
        if out is None:
            out = self.deferred.get(rid)
            if out is None:
                out = RequestOutput(rid)
            self.by_rid[rid] = out
        return out

    def accept(self, seq: Sequence, tok: GeneratedToken) -> FinishReason | None:
        """A row's token into its request's output, with its log-probabilities if asked for (to be read at the
        step's end) and its format's failure if the format could not go on; how the row ended, or None."""
        out = self.get(seq.rid)
        emitted = len(out.token_ids)
        finish = seq.accept(tok.token, tok.finish_reason, out)
        top = seq.req.params.logprobs
        if top is not None and len(out.token_ids) > emitted:  # it is one of the row's tokens: its logprob too
            vector = getattr(tok, "logprobs", None)
            if vector is not None:
                self.logprobs.append((out, tok.token, vector, top))
        if finish is None and seq.constraint is not None and seq.constraint.error:
            # Its format could not take a token its own mask allowed: what follows would not match it.
            out.finish, out.error_code = FinishReason.ERROR, ErrorCode.BAD_REQUEST
            out.error_message = f"the output could not go on in its format: {seq.constraint.error}"
            finish = FinishReason.ERROR
        return finish
