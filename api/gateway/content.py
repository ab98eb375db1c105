"""A chat message's content as both APIs send it (a string, or a list of typed parts) -> the wire schema's.

The one place content parts are mapped: the wire schema carries text only for now, so text parts are joined
(as ``mlx_lm.server`` joins them) and image parts are refused with a clear 400; when the schema carries
images, they pass through here.
"""

from __future__ import annotations

from typing import Any

from .errors import invalid

__all__ = ["chat_content"]

_IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})  # OpenAI's, Anthropic's, OpenAI Responses'


def chat_content(content: str | list[Any] | None, where: str) -> str:
    """The content of one message (``where`` names it in errors, e.g. ``messages[2]``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _IMAGE_PARTS:
            raise invalid(f"{where}.content[{i}]: image parts are not supported yet; send text parts only",
                          "unsupported_content")
        elif kind == "text":
            raise invalid(f"{where}.content[{i}]: a text part needs a string 'text'")
        else:
            raise invalid(f"{where}.content[{i}]: content parts of type {kind!r} are not supported; send text "
                          "parts only", "unsupported_content")
    return "".join(texts)
