"""One feeder's run of one batch (:class:`Drive`), resumed from Redis whoever ran it before: validating its
lines, feeding them a window at a time, and ending it (the output and error files written, the jobs still in
flight stopped). The lease, and which batches a feeder drives: api/feeder.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING

from .batches import RECORD, BatchStatus, banded, error_line, job_id, output_line
from .batchline import InputLines, LineError, custom_id_of, none_json, parse_line
from .errors import BadRequest, DuplicateJob, JobNotFound, MlxqError, NotFound, NoWorker, QueueFull
from .protocol.notify import publish
from .schema import DoneEvent, ErrorEvent, Event, FinishReason, GenerateRequest, is_terminal

if TYPE_CHECKING:
    from .feeder import BatchFeeder

__all__ = ["Drive"]

log = logging.getLogger(__name__)

_STATUS_POLL_S = 0.5  # how often a driven batch's status is read (a cancel, its expiry)
_BUSY_RETRY_S = 1.0  # a line refused by a full queue (or its tenant's quota) is offered again after this


class Drive:
    """One feeder's run of one batch: whatever its status says is next, resumed from Redis."""

    def __init__(self, feeder: BatchFeeder, bid: str) -> None:
        self.f = feeder
        self.bid = bid
        self.keys = feeder.batches.keys
        self.rec: dict[str, str] = {}
        self.input = InputLines(feeder.files, "")  # its file known once the record is read

    async def run(self) -> None:
        self.rec = await self.f.batches.record(self.bid)
        self.input = InputLines(self.f.files, self.rec.get("input_file_id", ""))
        if not self.rec:
            await self.f.redis.srem(self.keys.batches_open(), self.bid)
            return
        status = BatchStatus(self.rec["status"])
        if status is BatchStatus.VALIDATING:
            if not await self.validate():
                return
            status = BatchStatus(await self._status())
        if status is BatchStatus.IN_PROGRESS:
            status = await self.feed()
        if status is BatchStatus.CANCELLING:
            await self.finish("cancelled")
        elif status is BatchStatus.FINALIZING:
            await self.finish((await self._field("outcome")) or "completed")

    async def _status(self) -> str:
        return (await self._field("status")) or BatchStatus.FAILED.value

    async def _field(self, name: str) -> str | None:
        raw = await self.f.redis.hget(self.keys.batch(self.bid), name)
        return raw.decode() if raw is not None else None

    # --- validating -----------------------------------------------------------------------------------
    async def validate(self) -> bool:
        """Read every line once: count them, record each bad one's error (a malformed line, a duplicate
        custom_id, a body its endpoint refuses), and move to in progress; or fail the batch for its file."""
        fid, endpoint = self.rec["input_file_id"], self.rec["endpoint"]
        try:
            size, counts = await self.f.files.layout(fid)
            self.f.files.check(size, sum(counts))  # the limits now (they may be lower than at its upload)
        except NotFound:
            return await self._fail("invalid_file", f"the input file {fid} no longer exists")
        except MlxqError as exc:
            return await self._fail("file_too_large", str(exc))
        seen: set[str] = set()
        good, model = 0, ""
        records: list[tuple[int, str]] = []
        async for number, raw in self.input.every(counts):
            try:
                line = parse_line(number, raw, endpoint)
                if line.custom_id in seen:
                    raise LineError("duplicate_custom_id", f"line {number + 1}: custom_id {line.custom_id!r} "
                                    "is used by an earlier line")
                seen.add(str(line.custom_id))
                prepared = self.f.codec.prepare(endpoint, line.body)
                model = model or prepared.request.model
                good += 1
            except LineError as exc:
                cid = custom_id_of(raw)
                records.append((number, error_line(self.bid, number, cid, exc.code, exc.message)))
        total = sum(counts)
        if total == 0:
            return await self._fail("empty_file", "the input file has no lines")
        if good == 0 and none_json(records):  # not JSONL at all: the file's error, not each line's
            return await self._fail("invalid_json_line", "no line of the input file is a JSON object")
        for number, entry in records:
            await self._record(number, "e", entry)
        await self.f.redis.hset(self.keys.batch(self.bid), "total", total)  # also if it was cancelled meanwhile
        await self.f.batches.move(self.bid, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS,
                                  {"total": total, "model": model})
        log.info("batch %s: %d lines, %d to run", self.bid, total, good)
        return True

    async def _fail(self, code: str, message: str) -> bool:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        if await self.f.batches.move(self.bid, (BatchStatus.VALIDATING,), BatchStatus.FAILED,
                                     {"errors": json.dumps(errors)}):
            log.info("batch %s: failed: %s", self.bid, message)
            await publish(self.f.redis, self.keys, "batch.failed", self.bid, self.rec["tenant"])
        return False

    # --- in progress ----------------------------------------------------------------------------------
    async def feed(self) -> BatchStatus:
        """Keep up to ``window`` lines in flight until every line is recorded, the batch is cancelled, or its
        window passes; the status to go on with."""
        total = int(await self._field("total") or 0)
        followers: dict[int, asyncio.Task[None]] = {}
        for raw in await self.f.redis.smembers(self.keys.batch_inflight(self.bid)):  # a takeover: follow them on
            n = int(raw)
            followers[n] = asyncio.ensure_future(self._line(n))
        try:
            status = await self._feed(followers, total)
        finally:
            for task in followers.values():
                task.cancel()
            await asyncio.gather(*followers.values(), return_exceptions=True)
        return status

    async def _feed(self, followers: dict[int, asyncio.Task[None]], total: int) -> BatchStatus:
        next_line = int(await self._field("next") or 0)
        checked = 0.0
        while True:
            if time.monotonic() - checked > _STATUS_POLL_S:
                checked = time.monotonic()
                status = BatchStatus(await self._status())
                if status is not BatchStatus.IN_PROGRESS:
                    return status
                if time.time() >= int(self.rec["expires_at"]):
                    await self.f.batches.move(self.bid, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING,
                                              {"outcome": "expired"})
                    return BatchStatus(await self._status())
            while len(followers) < self.f.settings.window and next_line < total:
                n, next_line = next_line, next_line + 1
                if await self.f.redis.hexists(self.keys.batch_results(self.bid), str(n)):
                    await self.f.redis.hset(self.keys.batch(self.bid), "next", next_line)
                    continue  # recorded at validation (a bad line)
                async with self.f.redis.pipeline(transaction=True) as pipe:  # in flight before it is enqueued
                    pipe.sadd(self.keys.batch_inflight(self.bid), n)
                    pipe.hset(self.keys.batch(self.bid), "next", next_line)
                    await pipe.execute()
                followers[n] = asyncio.ensure_future(self._line(n))
            for n in [n for n, t in followers.items() if t.done()]:
                followers.pop(n).result()  # a follower's own failure (Redis away) ends this drive
            if not followers and next_line >= total:
                await self.f.batches.move(self.bid, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING,
                                          {"outcome": "completed"})
                return BatchStatus(await self._status())
            if followers:
                await asyncio.wait(list(followers.values()), timeout=_STATUS_POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)

    async def _line(self, n: int) -> None:
        """Run line ``n`` (or follow its job, enqueued already) to its end and record its outcome."""
        raw = await self.input.line(n)
        cid = custom_id_of(raw)
        try:
            line = parse_line(n, raw, self.rec["endpoint"])
            prepared = self.f.codec.prepare(self.rec["endpoint"], line.body)
            remaining = max(1.0, int(self.rec["expires_at"]) - time.time())
            request = banded(prepared.request, job_id(self.bid, n), self.rec["tenant"], remaining)
            events = await self._run(request)
            end = events[-1] if events else None
            if isinstance(end, DoneEvent) and end.finish_reason is FinishReason.CANCELLED:
                raise LineError(await self._cancel_code(), "the request was cancelled before it finished")
            if isinstance(end, ErrorEvent) and end.code.value == "expired":
                raise LineError("batch_expired", "the batch's window passed before the request ran")
            body = prepared.render(events)
        except LineError as exc:
            await self._record(n, "e", error_line(self.bid, n, cid, exc.code, exc.message))
            return
        usage = body.get("usage") or {}
        await self._record(n, "o", output_line(self.bid, n, str(cid), request.id, body),
                           usage.get("prompt_tokens", usage.get("input_tokens", 0)),
                           usage.get("completion_tokens", usage.get("output_tokens", 0)))

    async def _cancel_code(self) -> str:
        status = await self._status()
        if status == BatchStatus.CANCELLING.value:
            return "batch_cancelled"
        return "batch_expired" if await self._field("outcome") == "expired" else "cancelled"

    async def _run(self, request: GenerateRequest) -> list[Event]:
        """Enqueue the line's job (a job of that id already there is this line's, fed before) and read its
        events to its end; a job the queue forgot (it ended and its events expired while no feeder ran) runs
        again."""
        for _ in range(3):
            await self._submit(request)
            try:
                events = [ev async for ev in self.f.client.events(request.id)]
            except JobNotFound:
                continue
            if events and is_terminal(events[-1]):
                return events
        raise LineError("server_error", "the request's job ended and its events expired before they were read")

    async def _submit(self, request: GenerateRequest) -> None:
        waited = time.monotonic()
        while True:
            try:
                await self.f.client.submit(request, require_worker=True)
                return
            except DuplicateJob:
                return  # fed before (by this feeder or another): follow it
            except BadRequest as exc:  # what the client refuses to queue (a job over the payload limit)
                raise LineError("invalid_request", str(exc)) from None
            except QueueFull:
                await asyncio.sleep(_BUSY_RETRY_S)  # the queue, or the tenant's quota, is full: later
            except NoWorker as exc:  # a worker restarting may serve it again shortly
                if time.monotonic() - waited > self.f.settings.no_worker_grace_s:
                    raise LineError("model_not_found", str(exc)) from None
                await asyncio.sleep(_BUSY_RETRY_S)

    async def _record(self, n: int, kind: str, entry: str, input_tokens: int = 0, output_tokens: int = 0) -> bool:
        recorded = await RECORD.run(
            self.f.redis, {"results_key": self.keys.batch_results(self.bid),
                           "inflight_key": self.keys.batch_inflight(self.bid), "batch_key": self.keys.batch(self.bid)},
            {"line": n, "kind": kind, "entry": entry, "input_tokens": int(input_tokens),
             "output_tokens": int(output_tokens)})
        return bool(recorded)

    # --- the end --------------------------------------------------------------------------------------
    async def finish(self, outcome: str) -> None:
        """End the batch as ``outcome`` (completed, cancelled or expired): stop the jobs still in flight (their
        finished lines kept), record every line left as that outcome's error, write the output and error
        files, and notify."""
        code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(outcome)
        total = int(await self._field("total") or 0)
        if code is not None:
            await self._stop_inflight(code)
            for n in await self._unrecorded(total):
                cid = custom_id_of(await self.input.line(n))
                await self._record(n, "e", error_line(self.bid, n, cid, code, f"the batch was {outcome} "
                                                      "before this request finished"))
        fields = await self._write_files(total)
        status = {"completed": BatchStatus.COMPLETED, "cancelled": BatchStatus.CANCELLED,
                  "expired": BatchStatus.EXPIRED}[outcome]
        if await self.f.batches.move(self.bid, (BatchStatus.FINALIZING, BatchStatus.CANCELLING), status, fields):
            async with self.f.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.keys.batch_results(self.bid), self.keys.batch_inflight(self.bid))
                await pipe.execute()
            log.info("batch %s: %s", self.bid, outcome)
            await publish(self.f.redis, self.keys, f"batch.{outcome}", self.bid, self.rec["tenant"])

    async def _unrecorded(self, total: int) -> list[int]:
        """The lines with no outcome recorded."""
        missing = []
        for start in range(0, total, 1000):
            numbers = list(range(start, min(total, start + 1000)))
            got = await self.f.redis.hmget(self.keys.batch_results(self.bid), [str(n) for n in numbers])
            missing += [n for n, entry in zip(numbers, got) if entry is None]
        return missing

    async def _stop_inflight(self, code: str) -> None:
        """Cancel the jobs in flight and record each as it ends (a finished one is kept)."""
        lines = [int(r) for r in await self.f.redis.smembers(self.keys.batch_inflight(self.bid))]
        await asyncio.gather(*(self._settle(n, code) for n in lines))

    async def _settle(self, n: int, code: str) -> None:
        """Line ``n`` after its cancel: its job's end recorded (finished: kept), or, for a job never enqueued
        (its feeder stopped in between), the batch's end."""
        try:
            await self.f.client.cancel(job_id(self.bid, n))
        except JobNotFound:
            cid = custom_id_of(await self.input.line(n))
            await self._record(n, "e", error_line(self.bid, n, cid, code, "the batch ended before this request ran"))
            return
        except MlxqError:
            pass
        with contextlib.suppress(MlxqError, TimeoutError):
            async with asyncio.timeout(30):
                await self._line(n)

    async def _write_files(self, total: int) -> dict[str, str]:
        """The output and error files, lines in input order; their ids (named after the batch: written again
        after a takeover, the same files)."""
        out: list[bytes] = []
        err: list[bytes] = []
        for start in range(0, total, 1000):
            numbers = [str(n) for n in range(start, min(total, start + 1000))]
            for entry in await self.f.redis.hmget(self.keys.batch_results(self.bid), numbers):
                if entry is not None:
                    (out if entry[:1] == b"o" else err).append(entry[1:] + b"\n")
        fields = {}
        stem = self.bid.removeprefix("batch_")
        expires_s = int(self.rec.get("output_ttl_s") or 0) or None  # output_expires_after (None: the retention)
        for kind, lines, purpose in (("output", out, "batch_output"), ("error", err, "batch_error")):
            if lines:
                fid = f"file-{stem}-{kind}"
                await self.f.files.create(b"".join(lines), f"{self.bid}_{kind}.jsonl", purpose, self.rec["tenant"],
                                          file_id=fid, expires_after_s=expires_s)
                fields[f"{kind}_file_id"] = fid
        return fields
