"""A batch's input lines: the line format (``{custom_id, method, url, body}``) and its errors, what an endpoint
makes of a line's body (:class:`LineCodec`, the gateway's in api/gateway/batch_lines.py), and the input file
read line by line (:class:`InputLines`), a chunk in memory at a time."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .files import FileStore
from .schema import Event, GenerateRequest

__all__ = ["InputLines", "Line", "LineCodec", "LineError", "Prepared", "chunk_lines", "custom_id_of", "none_json",
           "parse_line"]


class LineError(Exception):
    """A line that cannot run: its error file entry's code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Prepared(Protocol):
    """A line made into its job, and the way back from the job's events to the endpoint's response body."""

    @property
    def request(self) -> GenerateRequest:
        """The line's job (its id, tenant and band are set by the feeder)."""
        ...

    def render(self, events: Sequence[Event]) -> dict[str, Any]:
        """The response body of a job that ended with ``events``; :class:`LineError` for a failed one."""
        ...


class LineCodec(Protocol):
    """What a batch line's body means for each endpoint (the gateway's own parsing: api/gateway/batch_lines.py)."""

    def prepare(self, endpoint: str, body: Any) -> Prepared:
        """The job of a line's ``body`` for ``endpoint``; :class:`LineError` for a body the endpoint refuses."""
        ...


@dataclass(slots=True)
class Line:
    """A well-formed line: its number, its custom_id and its request's body."""

    number: int
    custom_id: str | None
    body: Any


def parse_line(number: int, raw: bytes, endpoint: str) -> Line:
    """A line's request (``{custom_id, method, url, body}``); :class:`LineError` for a malformed one."""
    where = f"line {number + 1}"
    try:
        obj = json.loads(raw)
    except ValueError:
        raise LineError("invalid_json_line", f"{where}: not a JSON object") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", f"{where}: not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("missing_custom_id", f"{where}: custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"{where}: method must be POST")
    if obj.get("url") != endpoint:
        raise LineError("invalid_url", f"{where}: url {obj.get('url')!r} is not the batch's endpoint {endpoint}")
    if not isinstance(obj.get("body"), dict):
        raise LineError("invalid_body", f"{where}: body must be a JSON object")
    return Line(number, cid, obj["body"])


def custom_id_of(raw: bytes) -> str | None:
    """A line's custom_id, if it has one (a malformed line may: its error entry names it)."""
    with contextlib.suppress(ValueError):
        obj = json.loads(raw)
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
            return str(obj["custom_id"])
    return None


def none_json(records: list[tuple[int, str]]) -> bool:
    """Whether every error entry is ``invalid_json_line`` (a file that is not JSONL at all)."""
    return all(json.loads(entry)["error"]["code"] == "invalid_json_line" for _, entry in records)


def chunk_lines(chunk: bytes) -> list[bytes]:
    """A chunk's lines, without their newlines (a last line without one included)."""
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
        lines.pop()
    return lines


class InputLines:
    """A batch's input file, line by line: every line once (validation), or line ``n`` (feeding, its chunk read
    once and kept while lines of it are fed)."""

    def __init__(self, files: FileStore, file_id: str) -> None:
        self.files = files
        self.file_id = file_id
        self._chunk: tuple[list[int], int, list[bytes]] | None = None  # (line counts, chunk index, its lines)

    async def every(self, counts: list[int]) -> AsyncIterator[tuple[int, bytes]]:
        """Every line with its number, a chunk in memory at a time (``counts``: each chunk's lines)."""
        number = 0
        for i in range(len(counts)):
            for raw in chunk_lines(await self.files.chunk(self.file_id, i)):
                yield number, raw
                number += 1

    async def line(self, n: int) -> bytes:
        """Line ``n`` of the input file."""
        if self._chunk is None:
            self._chunk = (await self.files.line_counts(self.file_id), -1, [])
        counts, index, lines = self._chunk
        start = 0
        for i, c in enumerate(counts):
            if n < start + c:
                if i != index:
                    lines = chunk_lines(await self.files.chunk(self.file_id, i))
                    self._chunk = (counts, i, lines)
                return lines[n - start]
            start += c
        raise IndexError(n)
