"""A chat message's content as both APIs send it (a string, or a list of typed parts) -> the wire schema's.

The one place content parts are mapped: text parts, and images as OpenAI sends them (``image_url`` parts)
or Anthropic does (``image`` blocks with a base64 or url source), become the schema's text and image parts;
a message without images stays one string (its text parts joined, as ``mlx_lm.server`` joins them). Whether
the model takes images, and each image's bytes and pixels, the worker judges.
"""

from __future__ import annotations

from typing import Any

from ..schema import ContentPart, ImagePart, ImageURL, TextPart
from .errors import invalid

__all__ = ["chat_content"]


def chat_content(content: str | list[Any] | None, where: str) -> str | list[ContentPart]:
    """The content of one message (``where`` names it in errors, e.g. ``messages[2]``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    if not any(isinstance(p, ImagePart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return parts


def _part(part: Any, where: str) -> ContentPart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}: a text part needs a string 'text'")
        return TextPart(type="text", text=part["text"])
    if kind == "image_url":  # OpenAI: {"image_url": {"url": ..., "detail": ...}} (or the URL alone)
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise invalid(f"{where}: an image_url part needs image_url.url")
        return ImagePart(type="image_url", image_url=ImageURL(url=url))
    if kind == "image":  # Anthropic: {"source": {"type": "base64", "media_type": ..., "data": ...} | "url"}
        return ImagePart(type="image_url", image_url=ImageURL(url=_anthropic_source(part.get("source"), where)))
    raise invalid(f"{where}: content parts of type {kind!r} are not supported; send text and image parts",
                  "unsupported_content")


def _anthropic_source(source: Any, where: str) -> str:
    if not isinstance(source, dict):
        raise invalid(f"{where}: an image block needs a source")
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else "image/png"
        return f"data:{media};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise invalid(f"{where}: an image source is base64 (media_type, data) or url")
