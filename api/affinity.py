"""A job's affinity key: which of a model's jobs share a prompt's start, so they prefer one worker's prefix cache.

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
"""

from __future__ import annotations

import hashlib
import json

from .schema import GenerateRequest

__all__ = ["KEY_HEX", "PROMPT_CHARS", "affinity_key"]

KEY_HEX = 16  # 64 bits: two conversations colliding only share a preference, never a cache entry
PROMPT_CHARS = 1024  # about 250 tokens: a raw prompt's start that its later turns repeat


def affinity_key(req: GenerateRequest) -> str:
    """The job's affinity key (``KEY_HEX`` hex digits), or "" when it has none worth following."""
    if req.prompt_cache_key is not None:
        source = "k\0" + req.prompt_cache_key
    elif req.messages is not None:
        source = "c\0" + _stable_turns(req)
    elif req.prompt is not None and len(req.prompt) >= PROMPT_CHARS:
        source = "p\0" + req.prompt[:PROMPT_CHARS]
    else:
        return ""
    digest = hashlib.sha256(f"{req.model}\0{source}".encode(errors="surrogatepass"))
    return digest.hexdigest()[:KEY_HEX]


def _stable_turns(req: GenerateRequest) -> str:
    """The leading system turns, the first turn after them, and the tools, as one text."""
    messages = req.messages or []
    n = 0
    while n < len(messages) and messages[n].role == "system":
        n += 1
    stable = messages[:n + 1]
    turns = json.dumps([m.model_dump(mode="json", exclude_none=True) for m in stable], sort_keys=True,
                       separators=(",", ":"))
    return turns + "\0" + (req.tools_json if req.tools else "")
