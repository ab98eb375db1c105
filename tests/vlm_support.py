"""Helpers for the vision-language tests: small deterministic images and mlx-vlm's own single-request output,
the oracle every batched run must equal."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from mlxq.api.schema import image_data_url


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB picture as PNG bytes (seeded: the same bytes every time)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def picture(width: int, height: int, seed: int) -> Any:
    """The PIL image of :func:`png` (decoded from its bytes, RGB)."""
    from PIL import Image

    return Image.open(io.BytesIO(png(width, height, seed))).convert("RGB")


def data_url(width: int, height: int, seed: int) -> str:
    return image_data_url(png(width, height, seed))


def chat(text: str, *urls: str, text_after: str = "") -> list[dict[str, Any]]:
    """One user message: text, then images (OpenAI content parts), then more text."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    if text_after:
        parts.append({"type": "text", "text": text_after})
    return [{"role": "user", "content": parts}]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them (an image part becomes {"type": "image"})."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    return [p["image_url"]["url"] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p["type"] == "image_url"]


class Oracle:
    """mlx-vlm's single-request greedy generation (``mlx_vlm.stream_generate``), its own model copy, its own
    image decoding (from the data URLs), run in the calling thread."""

    def __init__(self, path: Path) -> None:
        import mlx_vlm

        from mlxq.engine.mlx.vlm import Vision

        self.model, self.processor = mlx_vlm.load(str(path))
        self.vision = Vision(self.model, self.processor)
        self._memo: dict[tuple[str, tuple[str, ...], int], tuple[list[int], str]] = {}

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """The chat prompt text (text-only messages: the tokenizer's template, as the worker renders them)."""
        urls = image_urls(messages)
        if urls:
            return self.vision.render(template_messages(messages), len(urls))
        plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                  else "".join(p["text"] for p in m["content"])} for m in messages]
        return str(self.processor.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))

    def tokens(self, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
        return self.tokens_of(self.prompt(messages), image_urls(messages), max_tokens)

    def text(self, messages: list[dict[str, Any]], max_tokens: int) -> str:
        """The text mlx-vlm streams for those tokens."""
        return self._run(self.prompt(messages), image_urls(messages), max_tokens)[1]

    def tokens_of(self, prompt: str, urls: list[str], max_tokens: int) -> list[int]:
        """Greedy tokens of a prompt text (a raw prompt, or a rendered chat) with its images' URLs."""
        return self._run(prompt, urls, max_tokens)[0]

    def text_of(self, prompt: str, urls: list[str], max_tokens: int) -> str:
        return self._run(prompt, urls, max_tokens)[1]

    def _run(self, prompt: str, urls: list[str], max_tokens: int) -> tuple[list[int], str]:
        import mlx_vlm

        key = (prompt, tuple(urls), max_tokens)
        if key not in self._memo:
            last, text = None, ""
            for last in mlx_vlm.stream_generate(self.model, self.processor, key[0],
                                                image=list(key[1]) or None,
                                                max_tokens=max_tokens, temperature=0.0):
                text += last.text
            assert last is not None
            self._memo[key] = (list(last.token_ids), text)  # the last item repeats the final token: its token_ids
        return self._memo[key]
