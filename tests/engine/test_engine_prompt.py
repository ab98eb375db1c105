"""The system-prompt boundary found by rendering the messages with an empty user turn (as mlx-lm's server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxq.engine.core.prompt import EncodedPrompt, PromptEncoder, encode_prompt, encode_prompt_with_boundary

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))[1]


def test_boundary_ends_after_the_system_prompt_and_the_next_turns_header(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    e = encode_prompt_with_boundary(tokenizer, None, messages)
    assert e.tokens == encode_prompt(tokenizer, None, messages)
    assert tokenizer.decode(e.tokens[: e.cache_boundary]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    # Another conversation with the same system prompt starts with the same tokens.
    other = encode_prompt(tokenizer, None, [messages[0], {"role": "user", "content": "Something else entirely"}])
    assert other[: e.cache_boundary] == e.tokens[: e.cache_boundary]
    assert PromptEncoder(tokenizer).encode_with_boundary(None, messages) == e


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "no system prompt"}],
    [{"role": "system", "content": "only a system prompt"}],
])
def test_no_boundary_without_a_system_prompt_followed_by_a_turn(tokenizer: Any, messages: list[dict[str, str]]
                                                                ) -> None:
    assert encode_prompt_with_boundary(tokenizer, None, messages).cache_boundary == 0


def test_several_system_messages_and_earlier_turns(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "A."}, {"role": "system", "content": "B."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}]
    e = encode_prompt_with_boundary(tokenizer, None, messages)
    assert tokenizer.decode(e.tokens[: e.cache_boundary]).endswith("B.<|im_end|>\n<|im_start|>user\n")


def test_text_prompts_have_no_boundary(tokenizer: Any) -> None:
    assert encode_prompt_with_boundary(tokenizer, "plain text", None) == EncodedPrompt(
        encode_prompt(tokenizer, "plain text", None), 0)
    assert PromptEncoder(tokenizer).encode_with_boundary("plain text", None).cache_boundary == 0
