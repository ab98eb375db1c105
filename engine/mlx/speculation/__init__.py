"""Speculative decoding on MLX: the speculative batch (``batch.py``) and what proposes its tokens
(``proposers.py``). How an engine speculates, and the choice of each step's ``k``, are the core's
(``engine/core/speculation/``)."""
