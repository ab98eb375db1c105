"""Settings declared once: each ``MLXQ_*`` variable's name, default, bounds and one line of meaning live on the
field of the config dataclass that holds it (:func:`setting`), and everything else is made from there.

Reading them from the environment (:func:`read`), the CLI's ``--help`` (:func:`help_text`) and the operators'
reference table in ``deploy/README.md`` (:func:`markdown`, printed by ``python3 -m mlxq.worker.config``) all
come from the declarations. The type is the default's (text, integer, number, flag; ``None``: a number or
unset), or a field's own ``parse``. A value that does not parse, or is out of bounds, raises
:class:`~api.errors.ConfigError`: one line naming the variable.
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .connection import SENTINEL_SCHEMES, sentinel_url
from .errors import ConfigError

__all__ = ["INTERNAL", "Setting", "declared", "help_text", "markdown", "names", "parse_redis_url", "read", "setting",
           "shared", "undeclared"]

_KEY = "mlxq_setting"
INTERNAL = frozenset({"MLXQ_BENCH_REEXEC"})  # set by `mlxq bench` in the process it re-executes, never by an operator
REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``MLXQ_*`` variable: its name, meaning, lower bound (numbers), how the docs show its default where
    the value alone would mislead, and a parser for a value that is not plain text, a number or a flag."""

    name: str
    doc: str
    minimum: float | None = None
    shown: str | None = None
    parse: Callable[[str, str], Any] | None = None  # (name, raw value) -> value; raises ConfigError


def setting(name: str, default: Any, doc: str, *, minimum: float | None = None, shown: str | None = None,
            parse: Callable[[str, str], Any] | None = None) -> Any:
    """A config dataclass field read from the variable ``name`` (``default`` when unset)."""
    return dataclasses.field(default=default, metadata={_KEY: Setting(name, doc, minimum, shown, parse)})


def shared(cls: type, attr: str) -> Any:
    """The field ``attr`` of ``cls``, declared again on another config: a variable both sides read (the same
    declaration, so the same name, default and bounds)."""
    found = {f.name: f for f in dataclasses.fields(cls)}[attr]
    return dataclasses.field(default=found.default, metadata=found.metadata)


def declared(cls: type) -> list[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of ``cls`` read from the environment, with their settings, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def names(classes: Iterable[type]) -> frozenset[str]:
    """The variables the config dataclasses ``classes`` declare."""
    return frozenset(s.name for cls in classes for _, s in declared(cls))


def undeclared(env: Mapping[str, str], known: Collection[str]) -> list[str]:
    """One warning line for each ``MLXQ_*`` variable of ``env`` that is not in ``known`` (nor internal), naming
    the closest declared name: a misspelt setting is otherwise ignored without a word."""
    lines = []
    for name in sorted(n for n in env if n.startswith("MLXQ_") and n not in known and n not in INTERNAL):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"{name} is not an mlxq setting: ignored{hint}")
    return lines


def read(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """The values of ``cls``'s settings that ``env`` sets, by field name (``cls(**read(cls, env))``: the rest
    keep their defaults). Blank numbers and flags count as unset; text is taken as given."""
    values: dict[str, Any] = {}
    for f, s in declared(cls):
        raw = env.get(s.name)
        if raw is None:
            continue
        if s.parse is not None:
            values[f.name] = s.parse(s.name, raw)
        elif isinstance(f.default, str):
            values[f.name] = raw
        elif raw.strip():
            values[f.name] = _value(s, f.default, raw)
    return values


def _value(s: Setting, default: Any, raw: str) -> Any:
    if isinstance(default, bool):
        return _flag(s.name, raw)
    kind: type = int if isinstance(default, int) else float
    what = "an integer" if kind is int else "a number"
    try:
        value = kind(raw.strip())
    except ValueError:
        raise ConfigError(f"{s.name}={raw!r}: expected {what}") from None
    if value != value or (s.minimum is not None and value < s.minimum):  # NaN, or below the bound
        raise ConfigError(f"{s.name}={raw!r}: expected {what} >= {s.minimum:g}")
    return value


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def parse_redis_url(name: str, raw: str) -> str:
    """A Redis URL as redis-py reads it (``redis://``, ``rediss://`` or ``unix://``), or a Sentinel set's
    (``redis+sentinel://``, ``rediss+sentinel://``: :func:`~api.connection.sentinel_url`), else
    :class:`ConfigError` (redis-py's own complaint is a ``ValueError`` at the first connection)."""
    scheme = urlsplit(raw.strip()).scheme if "://" in raw else ""
    if scheme in REDIS_SCHEMES:
        return raw.strip()
    if scheme in SENTINEL_SCHEMES:
        try:
            sentinel_url(raw)
        except ConfigError as exc:
            raise ConfigError(f"{name}={exc}") from None
        return raw.strip()
    shown, hint = raw, f" (e.g. redis://{raw.strip()})" if raw.strip() and "://" not in raw else ""
    if "@" in raw:  # never echo a password
        shown, hint = "<a URL with credentials>", " (e.g. redis://:PASSWORD@HOST:PORT)"
    raise ConfigError(f"{name}={shown!r}: expected a URL redis://HOST:PORT, rediss://HOST:PORT, unix:///PATH "
                      f"or redis+sentinel://HOST:PORT,HOST:PORT/MASTER{hint}")


def _shown(s: Setting, default: Any) -> str:
    if s.shown is not None:
        return s.shown
    if isinstance(default, bool):
        return "1" if default else "0"
    if default is None or default == "" or default == frozenset():
        return "unset"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _kind(s: Setting, default: Any) -> str:
    if s.parse is not None or isinstance(default, str | frozenset):
        return "text"
    if isinstance(default, bool):
        return "flag"
    what = "integer" if isinstance(default, int) else "number"
    bound = f" ≥ {s.minimum:g}" if s.minimum is not None else ""
    return f"{what}{bound}" + (", or unset" if default is None else "")


def help_text(classes: Iterable[type], *, only: Collection[str] | None = None,
              notes: Mapping[str, str] | None = None, pad: int | None = None, width: int = 118) -> str:
    """The settings of ``classes`` (``only`` those named) as ``--help`` lines: name, meaning and default;
    ``notes`` replace a variable's whole line where a command reads it its own way."""
    notes = notes or {}
    rows = [(s.name, notes.get(s.name) or f"{s.doc} (default: {_shown(s, f.default)})")
            for cls in classes for f, s in declared(cls) if only is None or s.name in only]
    pad = pad or max(len(name) for name, _ in rows) + 2
    lines = []
    for name, text in rows:
        lines += textwrap.wrap(text, width, initial_indent=f"  {name:<{pad}}", subsequent_indent=" " * (pad + 2))
    return "\n".join(lines) + "\n"


def markdown(groups: Sequence[tuple[str, type]]) -> str:
    """The operators' reference: one row per variable (read by the groups named), as a Markdown table."""
    rows: dict[str, tuple[Setting, Any, list[str]]] = {}
    for group, cls in groups:
        for f, s in declared(cls):
            prev = rows.setdefault(s.name, (s, f.default, []))
            if prev[0] != s:
                raise ValueError(f"{s.name} is declared twice, differently ({group})")
            if group not in prev[2]:
                prev[2].append(group)
    lines = ["| Variable | Default | Type | Read by | Meaning |", "| --- | --- | --- | --- | --- |"]
    for s, default, readers in rows.values():
        lines.append(f"| `{s.name}` | {_md(_shown(s, default))} | {_kind(s, default)} | {', '.join(readers)} | "
                     f"{_md(s.doc)} |")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")
