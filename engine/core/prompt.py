"""Prompt text to token ids, the way mlx-lm does it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

__all__ = ["EncodedPrompt", "PromptEncoder", "encode_prompt", "encode_prompt_with_boundary", "system_boundary"]

log = logging.getLogger(__name__)

# Texts the direct call must encode exactly as the tokenizer's own ``encode`` before it is trusted.
_PROBES = ("Hello, world!", "  leading and trailing  ", "naïve café 東京 🙂", "line\nbreak\ttab", "a" * 300, "")


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A prompt's tokens, and how many of them are its system-prompt prefix (0: none), where the engine
    caches the KV (``EngineRequest.cache_boundary``)."""

    tokens: list[int]
    cache_boundary: int = 0


def encode_prompt(tokenizer: Any, prompt: str | None, messages: Sequence[dict[str, Any]] | None,
                  **template: Any) -> list[int]:
    """Tokenize a raw prompt as ``mlx_lm.generate`` does, or render chat messages with the chat template
    (``template``: its keyword arguments, e.g. ``enable_thinking``)."""
    if messages is not None:
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **template))
    if prompt is None:
        raise ValueError("no prompt")
    return list(tokenizer.encode(prompt, add_special_tokens=_add_special(tokenizer, prompt)))


def encode_prompt_with_boundary(
    tokenizer: Any, prompt: str | None, messages: Sequence[dict[str, Any]] | None, **template: Any
) -> EncodedPrompt:
    """:func:`encode_prompt` and the system-prompt boundary of chat messages (:func:`system_boundary`)."""
    tokens = encode_prompt(tokenizer, prompt, messages, **template)
    boundary = system_boundary(tokenizer, messages, tokens, **template) if messages is not None else 0
    return EncodedPrompt(tokens, boundary)


def system_boundary(tokenizer: Any, messages: Sequence[dict[str, Any]], tokens: list[int], **template: Any) -> int:
    """Where the leading system messages of ``messages`` end in their rendered ``tokens``, as mlx-lm's server
    finds it: render those messages with an empty user turn after them; the tokens both renderings share are
    the prefix every conversation with that system prompt starts with. 0 without a system message (or when
    the template renders it differently in the two). ``template``: the keyword arguments the prompt was rendered
    with (its tools are part of the system prompt in most templates)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if n == 0 or n == len(messages):
        return 0
    probe = list(tokenizer.apply_chat_template([*messages[:n], {"role": "user", "content": ""}],
                                               add_generation_prompt=False, **template))
    shared = 0
    for a, b in zip(probe, tokens):
        if a != b:
            break
        shared += 1
    return shared if 0 < shared < len(tokens) else 0


class PromptEncoder:
    """:func:`encode_prompt` for one tokenizer, with raw prompts encoded by its Rust ``tokenizers.Tokenizer``
    directly when that gives the same ids.

    transformers encodes even one text through ``encode_batch``, which releases the GIL; taking it back
    waits for whatever Python the engine thread is running (up to the switch interval), once per prompt on
    the worker's event loop; ``Tokenizer.encode`` keeps the GIL. The direct call is
    used only for a fast tokenizer with no truncation, padding or special-token splitting set (what the
    wrapper would change), and only after it matched the wrapper on a few probe texts.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.direct = _rust_tokenizer(tokenizer)
        if self.direct is not None and not self._agrees():
            log.warning("the Rust tokenizer disagrees with the tokenizer's encode(); encoding through transformers")
            self.direct = None

    def encode(self, prompt: str | None, messages: Sequence[dict[str, Any]] | None, **template: Any) -> list[int]:
        if self.direct is None or messages is not None or prompt is None:
            return encode_prompt(self.tokenizer, prompt, messages, **template)
        ids: list[int] = self.direct.encode(prompt, add_special_tokens=_add_special(self.tokenizer, prompt)).ids
        return ids

    def encode_with_boundary(self, prompt: str | None, messages: Sequence[dict[str, Any]] | None,
                             **template: Any) -> EncodedPrompt:
        """:meth:`encode`, and the system-prompt boundary of chat messages."""
        tokens = self.encode(prompt, messages, **template)
        boundary = system_boundary(self.tokenizer, messages, tokens, **template) if messages is not None else 0
        return EncodedPrompt(tokens, boundary)

    def _agrees(self) -> bool:
        bos = getattr(self.tokenizer, "bos_token", None) or ""
        return all(self.encode(p, None) == encode_prompt(self.tokenizer, p, None) for p in (*_PROBES, bos + "x"))


def _add_special(tokenizer: Any, prompt: str) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return bos is None or not prompt.startswith(bos)


def _rust_tokenizer(tokenizer: Any) -> tokenizers.Tokenizer | None:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the transformers one
    rust = getattr(hf, "_tokenizer", None)
    if not isinstance(rust, tokenizers.Tokenizer) or getattr(hf, "split_special_tokens", False):
        return None
    if rust.truncation is not None or rust.padding is not None or rust.encode_special_tokens:
        return None
    return rust
