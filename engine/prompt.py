"""Prompt text to token ids, the way mlx-lm does it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["encode_prompt"]


def encode_prompt(tokenizer: Any, prompt: str | None, messages: Sequence[dict[str, str]] | None) -> list[int]:
    """Tokenize a raw prompt as ``mlx_lm.generate`` does, or render chat messages with the chat template."""
    if messages is not None:
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))
    if prompt is None:
        raise ValueError("no prompt")
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))
