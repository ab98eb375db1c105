"""The loader of the Lua scripts every process runs in Redis (the ``.lua`` files of this package's ``lua/``).

A script is one file, ``lua/<name>.lua``. A line ``--#include <part>`` in it stands for ``lua/<part>.lua``,
resolved by name (recursively; each part once per script, so two parts may both include the one they share); an
unknown part or a cycle is one :class:`ScriptError`. Nothing else in a file is rewritten.

What a script takes is declared once, in Python, beside its typed call, as a :class:`Layout`: its KEYS and ARGV
by name, and the repeated tail of each. From it the loader writes the script's prologue, a Lua local per name
(``local now_ms = ARGV[1]``; a tail as a list of rows), and the call builds its argument lists with
:meth:`Layout.pack` from the same names: no script reads ``ARGV[12 + 2 * queues]`` by position, and the two sides
cannot drift apart.

Constants the Lua needs from Python (TTLs, limits, histogram edges) are declared the same way: the prologue makes
each one a local of its name (``local OUTRANK_READ = 128``). Chosen over ARGV because a constant never changes
between calls: sending it with each one would only cost packing on the event loop (which shares the GIL with the
engine) and a ``tonumber`` in Lua. Chosen over substituting text into the body because the file stays the Lua that
runs, line for line after the prologue, and a constant is found by name like any local. The queue-name parts
(:data:`~mlxq.api.protocol.keys.QUEUE_NAMES`) are in every script's prologue: ``lua/queues.lua`` builds and parses
queue names from them, as :class:`~mlxq.api.protocol.keys.Keys` does in Python.

A :class:`Script` runs by SHA (EVALSHA), loading its text when Redis answers NOSCRIPT: on first use, and again
after a restart emptied Redis's script cache.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from .keys import QUEUE_NAMES

__all__ = ["Constant", "Layout", "Script", "ScriptError", "compose", "load"]

Constant = int | float | str | tuple[int, ...]

_INCLUDE = re.compile(r"^--#include[ \t]+(\S+)[ \t]*$", re.MULTILINE)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Lua's keywords, and the globals the scripts use: a declared name must not hide one.
_KEYWORDS = "and break do else elseif end false for function if in local nil not or repeat return then true until while"
_GLOBALS = "KEYS ARGV redis cjson string table math tonumber tostring type unpack ipairs pairs pcall error select next"
_RESERVED = frozenset(f"{_KEYWORDS} {_GLOBALS}".split())


class ScriptError(Exception):
    """A script that cannot be built: an unknown include, an include cycle, or a bad declaration."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A script's arguments by name: ``keys`` then the list ``key_tail`` (``""``: none) as KEYS; ``args`` then
    the rows ``arg_tail`` of the fields ``row`` (``""``: none) as ARGV. In Lua each name is a local: a key or
    argument its string, ``key_tail`` a list of keys, ``arg_tail`` a list of tables (``row.quota``)."""

    keys: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    key_tail: str = ""
    arg_tail: str = ""
    row: tuple[str, ...] = ()

    def names(self) -> list[str]:
        """Every name the prologue declares."""
        return [*self.keys, *self.args, *filter(None, (self.key_tail, self.arg_tail))]

    def index(self, arg: str) -> int:
        """Where ``arg`` is in the ARGV list :meth:`pack` builds (0-based)."""
        return self.args.index(arg)

    def pack(self, keys: Mapping[str, Any], args: Mapping[str, Any], key_tail: Sequence[Any] = (),
             rows: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV in the declared order; ``rows``: the ARGV tail, flat (``len(row)`` values a row).
        A missing or unknown name is a :class:`ScriptError`."""
        _same("KEYS", keys, self.keys)
        _same("ARGV", args, self.args)
        if (key_tail and not self.key_tail) or (rows and not self.arg_tail) or (self.row and len(rows) % len(self.row)):
            raise ScriptError(f"the tails {len(key_tail)} keys, {len(rows)} args do not fit {self}")
        return [*(keys[k] for k in self.keys), *key_tail], [*(args[a] for a in self.args), *rows]

    def prologue(self) -> str:
        """The Lua that gives each name its local."""
        lines = [f"local {n} = KEYS[{i}]" for i, n in enumerate(self.keys, 1)]
        lines += [f"local {n} = ARGV[{i}]" for i, n in enumerate(self.args, 1)]
        if self.key_tail:
            lines.append(f"local {self.key_tail} = {{}}")
            lines.append(f"for i = {len(self.keys) + 1}, #KEYS do {self.key_tail}[#{self.key_tail} + 1] = KEYS[i] end")
        if self.arg_tail:
            fields = ", ".join(f"{f} = ARGV[i + {k}]" for k, f in enumerate(self.row))
            lines.append(f"local {self.arg_tail} = {{}}")
            lines.append(f"for i = {len(self.args) + 1}, #ARGV, {len(self.row)} do "
                         f"{self.arg_tail}[#{self.arg_tail} + 1] = {{{fields}}} end")
        return "\n".join(lines)

    def check(self, constants: Iterable[str] = ()) -> None:
        """A :class:`ScriptError` unless every name (and each of ``constants``) is a distinct Lua name that hides no
        keyword or global, and an ARGV tail has both its name and its row."""
        _check_names([*constants, *self.names(), *self.row])
        if bool(self.arg_tail) != bool(self.row):
            raise ScriptError(f"an ARGV tail needs both its name and its row's fields: {self}")


def _same(what: str, given: Mapping[str, Any], declared: Iterable[str]) -> None:
    if given.keys() != set(declared):
        missing, unknown = set(declared) - given.keys(), given.keys() - set(declared)
        raise ScriptError(f"{what}: missing {sorted(missing)}, unknown {sorted(unknown)}")


def _check_names(names: Sequence[str]) -> None:
    bad = [n for n in names if not _NAME.match(n) or n in _RESERVED]
    if bad or len(set(names)) != len(names):
        raise ScriptError(f"names must be distinct Lua names hiding no keyword or global: {list(names)}")


def _lua(value: Constant) -> str:
    """A constant as a Lua literal."""
    if isinstance(value, bool):
        raise ScriptError("a constant is a number, a string or a tuple of integers, not a bool")
    if isinstance(value, tuple):
        return "{" + ",".join(str(int(v)) for v in value) + "}"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script called by SHA (loaded on first use, and again after a Redis restart emptied the cache)."""

    name: str
    layout: Layout
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    async def run(self, redis: Redis, keys: Mapping[str, Any], args: Mapping[str, Any],
                  key_tail: Sequence[Any] = (), rows: Sequence[Any] = ()) -> Any:
        """Run it with its arguments by name (:meth:`Layout.pack`)."""
        k, a = self.layout.pack(keys, args, key_tail, rows)
        return await self.call(redis, k, a)

    async def call(self, redis: Redis, keys: list[Any], args: list[Any]) -> Any:
        """Run it with lists packed already."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            await redis.script_load(self.source)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]


def _part(name: str) -> str:
    if not _NAME.match(name):
        raise ScriptError(f"no Lua part named {name!r}")
    try:
        return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()
    except FileNotFoundError:
        raise ScriptError(f"no Lua part named {name!r} (lua/{name}.lua)") from None


def _resolve(text: str, read: Callable[[str], str], stack: tuple[str, ...], seen: set[str]) -> str:
    def include(match: re.Match[str]) -> str:
        part = match.group(1)
        if part in stack:
            raise ScriptError(f"include cycle: {' -> '.join((*stack, part))}")
        if part in seen:
            return f"-- ({part}: included above)"
        seen.add(part)
        return _resolve(read(part), read, (*stack, part), seen).rstrip("\n")

    return _INCLUDE.sub(include, text)


def compose(name: str, text: str, layout: Layout, constants: Mapping[str, Constant] | None = None,
            read: Callable[[str], str] = _part) -> Script:
    """The script ``text`` (named ``name`` in errors): its includes resolved through ``read`` (a part's name ->
    its text), after a prologue declaring the queue-name parts, ``constants`` and ``layout``'s names."""
    consts = {**QUEUE_NAMES, **(constants or {})}
    layout.check(consts)
    body = _resolve(text, read, (name,), {name})
    head = [f"-- {name}: generated from its layout and constants (mlxq.api.protocol.scripts)"]
    head += [f"local {k} = {_lua(v)}" for k, v in consts.items()]
    return Script(name, layout, "\n".join([*head, layout.prologue(), body]))


def load(name: str, layout: Layout, constants: Mapping[str, Constant] | None = None) -> Script:
    """The shipped script ``lua/<name>.lua`` (see :func:`compose`)."""
    return compose(name, _part(name), layout, constants)
