"""The one walk down a trie of prefix entries (mlx-lm's ``PromptTrie``) that the prefix cache (``cache.py``) and its
tier on disk (``disk.py``) both make: how far a prompt goes into the entries, and an entry below where it stops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import PromptTrie

__all__ = ["Reach", "below", "reach"]


@dataclass(frozen=True, slots=True)
class Reach:
    """How far a prompt goes into a trie of entries (mlx-lm's ``PromptTrie``), found by one walk down its tokens.

    mlx-lm's ``PromptTrie.search`` finds the shortest entry longer than the prompt by a depth-first walk of
    everything below where the prompt leaves the trie, copying the path at each step: ~1 ms a prompt at a few
    hundred tokens and 32 entries, run for every idle affinity key each heartbeat (on the MLX thread), so with
    the tier on (whose keys stay held) it grew with the disk's entries. Any entry below serves the callers here
    (a longer entry is trimmed to the common part), and every node of the trie has one at or below it (an entry
    popped takes its emptied nodes with it), so one walk down the tokens and one down a branch suffice."""

    walked: int  # tokens the prompt shares with some entry at or below where it stopped
    exact: Any  # the value of the entry of exactly the prompt's tokens, or None
    shorter: Any  # the value of the longest entry that is a proper prefix of the prompt, or None
    shorter_len: int
    node: dict[Any, Any]  # where the walk stopped (holds an entry at or below it when walked > 0)


def reach(trie: PromptTrie, model: Any, tokens: Sequence[int]) -> Reach:
    """One walk of ``tokens`` down ``trie``'s entries of ``model`` (see :class:`Reach`)."""
    node: dict[Any, Any] = trie._trie.get(model, {})  # mlx-lm's trie as 0.32 keeps it: nested dicts by token
    shorter, shorter_len, walked = None, 0, 0
    for tok in tokens:
        if "__value__" in node:
            shorter, shorter_len = node["__value__"], walked
        nxt = node.get(tok)
        if nxt is None:
            break
        node, walked = nxt, walked + 1
    exact = node.get("__value__") if walked == len(tokens) else None
    return Reach(walked, exact, shorter if shorter_len > 0 else None, shorter_len, node)


def below(node: dict[Any, Any]) -> Any:
    """The value of an entry at or below ``node`` (down its first branch each step); None if there is none
    (never, while the trie is kept as mlx-lm keeps it)."""
    while "__value__" not in node:
        if not node:
            return None
        node = next(iter(node.values()))
    return node["__value__"]
