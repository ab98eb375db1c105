"""A job's affinity keys: which of a model's jobs share a prompt's start, so they prefer one worker's prefix cache.

Workers advertise the keys their prefix caches have warm (``worker/affinity.py``) and CLAIM prefers, for a worker,
the queued jobs whose key it has warm, leaving a job whose key another live worker has warm to that worker for at
most ``MLXQ_AFFINITY_WAIT_MS`` (``api/protocol/lua/affinity.lua``). The key is the request's ``prompt_cache_key``
(OpenAI's routing hint) if it has one, else one derived here, without a tokenizer (producers load no model), from
what stays the same across a conversation's turns:

- chat messages: the leading system turns, the tools, and the first turn after them (a conversation's first
  question never changes as it goes on, and it tells apart conversations that share a system prompt);
- a raw prompt: its first ``PROMPT_CHARS`` characters (a shorter prompt gets none: it prefills quickly anyway).

Either way it is hashed with the model's name into ``KEY_HEX`` hex digits: short, the same for every producer,
and namespaced by model (a key never matches another model's cache).

A chat job whose system turns and tools are long (``SYSTEM_CHARS``) gets a second, shallower key: theirs alone
(:func:`affinity_keys`, deepest first). Requests that share only a system prompt (single-turn RAG, classification,
agents: each a new user message) share that key, so they follow the worker holding the system prompt even though
no two of them share the deeper one; CLAIM follows the deepest key a live worker holds.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .schema import GenerateRequest

__all__ = ["KEY_HEX", "MAX_KEYS", "PROMPT_CHARS", "SYSTEM_CHARS", "affinity_key", "affinity_keys"]

KEY_HEX = 16  # 64 bits: two conversations colliding only share a preference, never a cache entry
PROMPT_CHARS = 1024  # about 250 tokens: a raw prompt's start that its later turns repeat
SYSTEM_CHARS = 512  # system turns and tools at least this long (~128 tokens: twice the prefix cache's floor) get
# a key of their own
MAX_KEYS = 3  # keys a job record carries at most (CLAIM reads them from the record's last bytes)


def affinity_key(req: GenerateRequest) -> str:
    """The job's deepest affinity key (``KEY_HEX`` hex digits), or "" when it has none worth following."""
    keys = affinity_keys(req)
    return keys[0] if keys else ""


def affinity_keys(req: GenerateRequest) -> tuple[str, ...]:
    """The job's affinity keys, deepest first (at most ``MAX_KEYS``): the conversation's, then (a chat with long
    system turns or tools) theirs alone; none when it has none worth following."""
    if req.prompt_cache_key is not None:  # the caller's grouping: followed as given
        return (_hashed(req, "k\0" + req.prompt_cache_key),)
    if req.messages is not None:
        system, first = _stable_turns(req)
        deep = _hashed(req, "c\0" + first)
        return (deep, _hashed(req, "s\0" + system)) if len(system) >= SYSTEM_CHARS else (deep,)
    if req.prompt is not None and len(req.prompt) >= PROMPT_CHARS:
        return (_hashed(req, "p\0" + req.prompt[:PROMPT_CHARS]),)
    return ()


def _hashed(req: GenerateRequest, source: str) -> str:
    digest = hashlib.sha256(f"{req.model}\0{source}".encode(errors="surrogatepass"))
    return digest.hexdigest()[:KEY_HEX]


def _stable_turns(req: GenerateRequest) -> tuple[str, str]:
    """The leading system turns with the tools, and those with the first turn after them, each as one text
    (the second as keys were derived before the system turns got a key of their own)."""
    messages = req.messages or []
    n = 0
    while n < len(messages) and messages[n].role == "system":
        n += 1
    tools = req.tools_json if req.tools else ""

    def text(turns: list[Any]) -> str:
        return json.dumps([m.model_dump(mode="json", exclude_none=True) for m in turns], sort_keys=True,
                          separators=(",", ":"))

    return (text(messages[:n]) + "\0" + tools if n or tools else ""), text(messages[:n + 1]) + "\0" + tools
