"""Lua scripts that make a job's writes conditional on who holds its lease (fencing).

A worker writes a job's events only while it holds the job's lease (value: its token, worker id + try).
A worker that lost its lease -- paused, partitioned, or reaped -- cannot publish over the job's next run.
The reaper writes only while *no one* holds the lease (token ""). One job's keys share the ``{rid}`` hash
tag; a call may write several jobs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

__all__ = ["CLAIM", "EMIT", "REFRESH", "START", "SWEEP", "Script"]

# Writes the events of several jobs in one call: one round trip per engine step whatever the batch size.
# KEYS: running. ARGV: job count, live TTL, done TTL, arq queue, now (ms), arq's in-progress key prefix, the
# key prefix, arq's job, retry and result key prefixes, the result TTL (ms), then the records of every job in
# one argument, each "<record bytes>\n<record>". A record is a line "<rid bytes> <token bytes> <mode> <first
# seq> <result bytes>", the rid, the token and the result back to back, a newline, and its events (JSON
# texts) joined by newlines (JSON never contains a raw one). Event i gets log entry id "<first seq + i>-1".
# A job's lease, log, cancel key and channel are named here from the prefix and rid, as api.keys.Keys names
# them, and the records travel as one argument: redis-py packs every argument in Python (~1.7 us each on a
# slow core), and packing was a quarter of the event loop's time in a 32-job write, which shares the GIL with
# the engine. (Keys undeclared in KEYS, and global ones: not Redis Cluster-ready.)
# Mode "": more to come; "end": terminal -- drop lease, cancel key and running entry, and finish the arq job
# as arq's own finish_job would (its in-progress, job and retry keys, its queue entry; the result, if any,
# kept for the result TTL), so a job's end costs no round trip of its own; "release": hand the job back --
# drop lease and running entry, clear arq's in-progress mark and re-queue it, all in this one atomic call, so
# no crash can leave a job neither running nor queued.
# Returns one 1 (written) or 0 (fenced: the lease is not this token's) per job. An entry id already in the
# log (a duplicate) is skipped, not published.
EMIT = r"""
local out = {}
local blob, pos = ARGV[12], 1
for j = 1, tonumber(ARGV[1]) do
  local nl = string.find(blob, '\n', pos, true)
  local size = tonumber(string.sub(blob, pos, nl - 1))
  local rec = string.sub(blob, nl + 1, nl + size)
  pos = nl + size + 1
  local h = string.find(rec, '\n', 1, true)
  local lr, lt, mode, seq, lres = string.match(string.sub(rec, 1, h - 1), '^(%d+) (%d+) (%a*) (%d+) (%d+)$')
  lr, lt, seq, lres = tonumber(lr), tonumber(lt), tonumber(seq), tonumber(lres)
  local rid, token = string.sub(rec, h + 1, h + lr), string.sub(rec, h + lr + 1, h + lr + lt)
  local base = ARGV[7] .. ':{' .. rid .. '}:'
  local lease, log = base .. 'lease', base .. 'log'
  local holder = redis.call('GET', lease)
  if (token == '' and not holder) or (token ~= '' and holder == token) then
    local channel = base .. 'events'
    for event in string.gmatch(string.sub(rec, h + lr + lt + lres + 2), '[^\n]+') do
      local r = redis.pcall('XADD', log, seq .. '-1', 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', channel, event)
      end
      seq = seq + 1
    end
    if mode == 'end' then
      redis.call('EXPIRE', log, ARGV[3])
      redis.call('DEL', base .. 'cancel', ARGV[6] .. rid, ARGV[8] .. rid, ARGV[9] .. rid)
      redis.call('ZREM', ARGV[4], rid)
      if lres > 0 then
        redis.call('SET', ARGV[10] .. rid, string.sub(rec, h + lr + lt + 1, h + lr + lt + lres), 'PX', ARGV[11])
      end
    else
      redis.call('EXPIRE', log, ARGV[2])
    end
    if mode ~= '' then
      redis.call('HDEL', KEYS[1], rid)
      if token ~= '' then redis.call('DEL', lease) end
    end
    if mode == 'release' then
      redis.call('DEL', ARGV[6] .. rid)
      redis.call('ZADD', ARGV[4], ARGV[5], rid)
    end
    out[j] = 1
  else
    out[j] = 0
  end
end
return out
"""

# Claims and starts every job one arq poll found, in one call: for each (up to the free slots), arq's claim
# (the job is queued, due and not in progress: set its in-progress key), then what arq's run_job reads first
# (the job, and its try count: INCR of its retry key), then the job's lease, taken with token
# "<worker id>:<try>". Leased: the job is listed as running and taken out of arq's queue (otherwise every
# poll re-examines every running job). If another run holds the lease: the job goes back to the queue, due
# later, and this claim is dropped. Also reads each job's last logged event and whether a cancel is pending.
# Keys are named here from the prefixes, as EMIT does (packing arguments costs the event loop).
# KEYS: arq queue, running. ARGV: now (ms), in-progress TTL (ms), most to start, worker id, lease TTL (ms),
# deferred score, key prefix, arq's in-progress, job and retry key prefixes, then the job ids.
# Returns one {id, score, job bytes or false, try, 1 if leased else 0, last event JSON or false, 1 if
# cancelled else 0} per claimed job.
START = """
local out = {}
local started, most = 0, tonumber(ARGV[3])
for i = 11, #ARGV do
  if started >= most then break end
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  local claim = ARGV[8] .. id
  if score and tonumber(score) <= tonumber(ARGV[1]) and redis.call('EXISTS', claim) == 0 then
    redis.call('PSETEX', claim, ARGV[2], '1')
    local job = redis.call('GET', ARGV[9] .. id)
    local try = redis.call('INCR', ARGV[10] .. id)
    redis.call('EXPIRE', ARGV[10] .. id, 88400)
    local base = ARGV[7] .. ':{' .. id .. '}:'
    local leased = redis.call('SET', base .. 'lease', ARGV[4] .. ':' .. try, 'NX', 'PX', ARGV[5])
    if leased then
      started = started + 1
      redis.call('HSET', KEYS[2], id, KEYS[1])
      redis.call('ZREM', KEYS[1], id)
    else
      redis.call('ZADD', KEYS[1], ARGV[6], id)
      redis.call('DEL', claim)
    end
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    out[#out + 1] = {id, score, job or false, try, leased and 1 or 0, last and last[2][2] or false,
                     redis.call('EXISTS', base .. 'cancel')}
  end
end
return out
"""

# arq's claim of queued jobs, for many at once: a job is taken if it is in the queue, due, and not in
# progress; taking it sets its in-progress key as arq does. KEYS: the arq queue, then each job's in-progress
# key. ARGV: now (ms), in-progress TTL (ms), most to take, then the job ids. Returns id, score, id, score...
# of the taken ones.
CLAIM = """
local out = {}
local most = tonumber(ARGV[3]) * 2
for i = 2, #KEYS do
  if #out >= most then break end
  local id = ARGV[i + 2]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if score and tonumber(score) <= tonumber(ARGV[1]) and redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('PSETEX', KEYS[i], ARGV[2], '1')
    out[#out + 1] = id
    out[#out + 1] = score
  end
end
return out
"""

# The running jobs that hold no lease, read in one atomic call: a job ending meanwhile (its EMIT "end" drops
# the lease and the running entry together) is never mistaken for a lost one, as it was when the entries
# and their leases were read in two calls. KEYS: running. ARGV: the key prefix. Returns rid, queue, ...
SWEEP = """
local out = {}
local running = redis.call('HGETALL', KEYS[1])
for i = 1, #running, 2 do
  if redis.call('EXISTS', ARGV[1] .. ':{' .. running[i] .. '}:lease') == 0 then
    out[#out + 1] = running[i]
    out[#out + 1] = running[i + 1]
  end
end
return out
"""

# KEYS: lease. ARGV: token, ttl ms. Extends the lease if still ours: 1, else 0.
REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script called by SHA inside pipelines (no per-pipeline SCRIPT EXISTS round trip)."""

    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> Script:
        """Without a round trip: :meth:`run` loads it on first use."""
        return cls(source, hashlib.sha1(source.encode()).hexdigest())

    @classmethod
    async def load(cls, redis: Redis, source: str) -> Script:
        return cls(source, await redis.script_load(source))

    async def reload(self, redis: Redis) -> None:
        """After a Redis restart emptied the script cache."""
        await redis.script_load(self.source)

    def call(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        """Queue the script on a pipeline."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def run(self, redis: Redis, keys: list[str], args: list[Any]) -> Any:
        """Run the script now, reloading it once if Redis lost its script cache (a restart)."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            await self.reload(redis)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]


def is_noscript(result: object) -> bool:
    return isinstance(result, NoScriptError)
