"""Corrections of mlx-lm's model code where a batch of rows of different lengths gets other tokens than each row
alone (an MLX adapter). Each is a subclass put onto the layers of a model mlxq loaded (:func:`correct`), never a
patch of mlx-lm's class: every other user of the process keeps mlx-lm's behaviour.

- Nemotron-H's Mamba-2 mixer (mlx-lm 0.32.2, ``models/nemotron_h.py``) does not pass the rows' lengths to
  ``ssm_update``, so a right-padded prefill (rows of different lengths prefilled together) carries a shorter
  row's state through its padding, and its tokens differ from its own (ml-explore/mlx-lm#1908; mamba2's,
  falcon_h1's and granitemoehybrid's mixers pass them). tests/engine/test_engine_families.py holds that mlx-lm
  alone still does this: when it stops, drop the correction.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.nemotron_h import NemotronHMamba2Mixer
from mlx_lm.models.ssm import ssm_update

__all__ = ["NemotronHMixerWithLengths", "correct"]

log = logging.getLogger(__name__)


class NemotronHMixerWithLengths(NemotronHMamba2Mixer):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's Nemotron-H Mamba-2 mixer whose state update sees each row's length (as granitemoehybrid's)."""

    def _ssm(self, hidden_states: mx.array, B: mx.array, C: mx.array, dt: mx.array, cache: Any,
             mask: mx.array | None) -> mx.array:
        """mlx-lm's ``NemotronHMamba2Mixer._ssm``, with ``cache.lengths`` passed on: a padded row's state is
        the one at its own last token."""
        batch_size, seq_len, _ = hidden_states.shape
        hidden_states = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim)
        B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        state, lengths = (cache[1], cache.lengths) if cache else (None, None)
        limit = cast("tuple[float, float]", self.time_step_limit)  # never None: ModelArgs.__post_init__ sets it
        y, state = ssm_update(hidden_states, self.A_log, B, C, self.D.astype(hidden_states.dtype), dt, self.dt_bias,
                              state, limit, mask, lengths)
        if cache:
            cache[1] = state
        return y.reshape(batch_size, seq_len, self.intermediate_size)


# mlx-lm's class → the corrected one put onto its instances.
_CORRECTED: dict[type, type] = {NemotronHMamba2Mixer: NemotronHMixerWithLengths}


def correct(model: Any) -> int:
    """Put the corrected classes onto ``model``'s layers that need them, in place (this model alone); how many.
    Run on the MLX thread, before the model's first batch."""
    count = 0
    for module in model.modules():
        fixed = _CORRECTED.get(type(module))
        if fixed is not None:
            module.__class__ = fixed
            count += 1
    if count:
        log.info("corrected %d layer(s) of mlx-lm's code in this model: rows of different lengths batched together "
                 "keep their own state (engine/mlx/fixes.py)", count)
    return count
