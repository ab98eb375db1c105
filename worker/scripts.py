"""The Lua scripts behind a job's transitions (worker/lifecycle.py calls them, with typed arguments).

Each transition is one script call, so it is atomic, and each checks in Redis that its caller may make it:
a run only while the job's lease holds that run's token, the reaper only while nobody holds it and the job's
log is where the reaper read it. A run that lost its lease (paused, partitioned, reaped, or its job finished
elsewhere) can therefore change nothing about the job, whenever it wakes up.

A job's keys are named here from the prefix and its id, as ``api.keys.Keys`` names them (``<prefix>:{<id>}:
lease`` and so on), rather than passed as KEYS: redis-py packs every argument in Python, on the event loop
that shares the GIL with the engine, so a step's records travel as one argument. (So the scripts are not
Redis Cluster-ready.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

__all__ = ["EMIT", "LAPSE", "REFRESH", "REJECT", "START", "SWEEP", "Script"]

# queued -> running, from several queues in one call. Reads the due entries of each queue whose quota is
# above 0 and starts, lowest score first across queues (the score orders by priority and enqueue time), up to
# each queue's quota and ARGV[2] in all: takes the lease with token "<worker id>:<try>", counts the try (only
# here: a try is a run that started), lists the job as running (value "<score> <queue>", so a hand-back can
# queue it in its old place) and takes it out of its queue and its deadline. A job whose lease another run
# still holds stays queued, due a lease TTL later, with no try counted. An entry that is no job id (not what a
# producer makes: wrong bytes or length) comes back as poison, one without a job record as gone: both for
# REJECT. Also reads the deployment's epoch (setting it if Redis has none: a fresh or emptied server), each
# started job's last logged event, and whether a cancel is pending; and whether due jobs were left queued
# (for lack of quota, or beyond the read limit).
# KEYS: running, epoch, deadlines, then the queues. ARGV: now ms, most, worker id, lease ms, prefix, a new epoch,
# epoch TTL s, tries TTL s, read limit per queue, then one quota per queue, then per queue "" or what a job needs
# to outrank a full engine's running sequences, "<priority> <aging ms> <PRIORITY_MIN>": from such a queue only
# the first jobs (up to its quota) of at least that priority are read, each one's priority recovered from its
# score and its record's enqueue time (records end with "et":<ms>}: api.jobrecord.job_record; GETRANGE reads only
# that tail), among the first _OUTRANK_READ entries that could have them (api.keys.queue_score: never above
# enqueue time).
# Returns {epoch, left 0|1, {id, queue, "started", score, job, try, last event or false, cancelled 0|1} |
# {id, queue, "deferred" | "gone" | "poison"}, ...}.
_OUTRANK_READ = 128  # queue entries START looks through for a job that outranks a full engine

START = """
local epoch = redis.call('GET', KEYS[2])
if not epoch then epoch = ARGV[6] end
redis.call('SET', KEYS[2], epoch, 'EX', ARGV[7])
local now, most, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[9])
local left, due, queues = 0, {}, #KEYS - 3
local function is_job_id(id)  -- what a producer makes; anything else in a queue is poison
  return #id <= 64 and string.match(id, '^[%w_.:%-]+$') ~= nil
end
local function outranking(q, need, aging, pmin, n)
  -- the first n queued jobs of priority >= need; score = enqueue - (priority - pmin) * aging
  local lead = (need - pmin) * aging  -- how far below its enqueue time such a job's score is, at least
  local entries = redis.call('ZRANGEBYSCORE', KEYS[q], '-inf', now - lead, 'WITHSCORES', 'LIMIT', 0, OUTRANK_READ)
  local found = {}
  for i = 1, #entries, 2 do
    if #found >= n then break end
    local id, score = entries[i], tonumber(entries[i + 1])
    if is_job_id(id) then
      local tail = redis.call('GETRANGE', ARGV[5] .. ':{' .. id .. '}:job', -32, -1)
      local et = tonumber(string.match(tail, '"et":(%d+)}$'))
      if et and et - score >= lead then found[#found + 1] = {id, score, q} end
    end
  end
  return found
end
for q = 4, #KEYS do
  local need, aging, pmin = string.match(ARGV[6 + q + queues], '^(%-?%d+) (%d+) (%-?%d+)$')
  if need and tonumber(ARGV[6 + q]) > 0 then
    local found = outranking(q, tonumber(need), tonumber(aging), tonumber(pmin), tonumber(ARGV[6 + q]))
    for _, entry in ipairs(found) do due[#due + 1] = entry end
    if redis.call('ZCOUNT', KEYS[q], '-inf', now) > #found then left = 1 end
  elseif tonumber(ARGV[6 + q]) > 0 then
    local entries = redis.call('ZRANGEBYSCORE', KEYS[q], '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
    if #entries >= 2 * limit then left = 1 end
    for i = 1, #entries, 2 do due[#due + 1] = {entries[i], tonumber(entries[i + 1]), q} end
  elseif redis.call('ZCOUNT', KEYS[q], '-inf', now) > 0 then
    left = 1
  end
end
table.sort(due, function(a, b)
  if a[2] ~= b[2] then return a[2] < b[2] end
  if a[3] ~= b[3] then return a[3] < b[3] end
  return a[1] < b[1]
end)
local out = {epoch, 0}
local started, taken = 0, {}
for _, entry in ipairs(due) do
  local id, score, q = entry[1], entry[2], entry[3]
  local queue = KEYS[q]
  if started >= most or (taken[q] or 0) >= tonumber(ARGV[6 + q]) then
    left = 1
  elseif not is_job_id(id) then
    out[#out + 1] = {id, queue, 'poison'}
  else
    local base = ARGV[5] .. ':{' .. id .. '}:'
    local job = redis.call('GET', base .. 'job')
    if not job then
      out[#out + 1] = {id, queue, 'gone'}
    else
      local try = tonumber(redis.call('GET', base .. 'tries') or '0') + 1
      if redis.call('SET', base .. 'lease', ARGV[3] .. ':' .. try, 'NX', 'PX', ARGV[4]) then
        started = started + 1
        taken[q] = (taken[q] or 0) + 1
        redis.call('SET', base .. 'tries', try, 'EX', ARGV[8])
        redis.call('HSET', KEYS[1], id, string.format('%d', score) .. ' ' .. queue)
        redis.call('ZREM', queue, id)
        redis.call('ZREM', KEYS[3], id .. '@' .. queue)
        local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
        out[#out + 1] = {id, queue, 'started', string.format('%d', score), job, try, last and last[2][2] or false,
                         redis.call('EXISTS', base .. 'cancel')}
      else
        redis.call('ZADD', queue, now + tonumber(ARGV[4]), id)
        out[#out + 1] = {id, queue, 'deferred'}
      end
    end
  end
end
out[2] = left
return out
""".replace("OUTRANK_READ", str(_OUTRANK_READ))

# running -> running | ended | queued, and queued -> ended (expired), for several jobs in one call (one round
# trip per engine step).
# KEYS: running, epoch, deadlines. ARGV: record count, live TTL s, done TTL s, now ms, prefix, result TTL ms, then every
# record in one argument, each "<size>\n<record>". A record is a line "<queue bytes> <rid bytes> <owner bytes>
# <write> <first seq> <result bytes>", then queue, rid, owner and result back to back, a newline, and its
# events (JSON texts, which never hold a raw newline) joined by newlines; event i is logged as entry
# "<first seq + i>-1" and published on the job's channel.
# The caller may write if (by write): a/e/h: owner is a run's token and the lease holds it, or owner is ""
# (the reaper) and nobody holds the lease, the job is listed as running, and its log's next seq is the
# record's first (two reapers cannot both act on one job); l: owner is the epoch the run started in and the
# epoch moved on (Redis lost its data since) and the job record is gone; x: owner is "" and the job is still
# queued (taking it out of its queue decides) and its log's next seq is the record's first.
# Writes: a: append. e: end: drop lease, running entry, cancel key, job record, tries and queue entry, keep
# the result (if any) for the result TTL and the log for the done TTL. h: hand back: drop lease and running
# entry, queue the job again in its old place (the score START listed it with), due at once. l: append, log
# kept for the done TTL. x: as e, and the job's deadline is dropped.
# Returns 1 (written) or 0 (refused) per record. An entry id already logged (a duplicate) is not published.
EMIT = r"""
local out = {}
local blob, pos = ARGV[7], 1
for j = 1, tonumber(ARGV[1]) do
  local nl = string.find(blob, '\n', pos, true)
  local size = tonumber(string.sub(blob, pos, nl - 1))
  local rec = string.sub(blob, nl + 1, nl + size)
  pos = nl + size + 1
  local h = string.find(rec, '\n', 1, true)
  local lq, lr, lo, write, seq, lres = string.match(string.sub(rec, 1, h - 1),
    '^(%d+) (%d+) (%d+) (%a) (%d+) (%d+)$')
  lq, lr, lo, seq, lres = tonumber(lq), tonumber(lr), tonumber(lo), tonumber(seq), tonumber(lres)
  local queue = string.sub(rec, h + 1, h + lq)
  local rid = string.sub(rec, h + lq + 1, h + lq + lr)
  local owner = string.sub(rec, h + lq + lr + 1, h + lq + lr + lo)
  local result = string.sub(rec, h + lq + lr + lo + 1, h + lq + lr + lo + lres)
  local base = ARGV[5] .. ':{' .. rid .. '}:'
  local lease, log = base .. 'lease', base .. 'log'
  local ok
  if write == 'l' then
    ok = redis.call('GET', KEYS[2]) ~= owner and redis.call('EXISTS', base .. 'job') == 0
  elseif write == 'x' then
    local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
    local next_seq = last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0
    ok = owner == '' and next_seq == seq and redis.call('ZREM', queue, rid) == 1
  elseif owner ~= '' then
    ok = redis.call('GET', lease) == owner
  else
    local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
    local next_seq = last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0
    ok = redis.call('EXISTS', lease) == 0 and redis.call('HEXISTS', KEYS[1], rid) == 1 and next_seq == seq
  end
  if ok then
    local channel = base .. 'events'
    for event in string.gmatch(string.sub(rec, h + lq + lr + lo + lres + 2), '[^\n]+') do
      local r = redis.pcall('XADD', log, seq .. '-1', 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', channel, event)
      end
      seq = seq + 1
    end
    if write == 'a' or write == 'h' then
      redis.call('EXPIRE', log, ARGV[2])
    else
      redis.call('EXPIRE', log, ARGV[3])
    end
    local requeue_at = ARGV[4]
    if write == 'h' then
      local entry = redis.call('HGET', KEYS[1], rid)
      requeue_at = entry and string.match(entry, '^(%-?%d+) ') or ARGV[4]
    end
    if write == 'e' or write == 'h' then
      redis.call('HDEL', KEYS[1], rid)
      redis.call('DEL', lease)
    end
    if write == 'e' or write == 'x' then
      redis.call('DEL', base .. 'cancel', base .. 'job', base .. 'tries')
      redis.call('ZREM', queue, rid)
      if lres > 0 then redis.call('SET', base .. 'result', result, 'PX', ARGV[6]) end
    end
    if write == 'x' then
      redis.call('ZREM', KEYS[3], rid .. '@' .. queue)
    elseif write == 'h' then
      redis.call('ZADD', queue, requeue_at, rid)
    end
    out[j] = 1
  else
    out[j] = 0
  end
end
return out
"""

# The reaper's read: every running job whose lease is gone. One whose log already ends with its terminal
# event only lost its bookkeeping: its running entry is dropped here. KEYS: running. ARGV: prefix.
# Returns {rid, queue, next seq, tries, 1 if its job record exists else 0, ...} for the others.
SWEEP = """
local out = {}
local running = redis.call('HGETALL', KEYS[1])
for i = 1, #running, 2 do
  local rid = running[i]
  local base = ARGV[1] .. ':{' .. rid .. '}:'
  if redis.call('EXISTS', base .. 'lease') == 0 then
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    local kind = last and cjson.decode(last[2][2])['type']
    if kind == 'done' or kind == 'error' then
      redis.call('HDEL', KEYS[1], rid)
    else
      local queue = string.match(running[i + 1], '^%-?%d+ (.*)$') or running[i + 1]
      out[#out + 1] = {rid, queue, last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0,
                       tonumber(redis.call('GET', base .. 'tries') or '0'), redis.call('EXISTS', base .. 'job')}
    end
  end
end
return out
"""

# The expiry sweep's read: queued jobs whose deadline passed. Members whose job is no longer queued (started,
# ended, or gone) are dropped here. KEYS: deadlines. ARGV: now ms, prefix, most.
# Returns {rid, queue, next seq, enqueue ms (0 if the record is gone), cancel requested 0|1, ...}.
LAPSE = """
local out = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))) do
  local at = string.find(member, '@', 1, true)
  local rid = at and string.sub(member, 1, at - 1)
  local queue = at and string.sub(member, at + 1)
  if at and redis.call('ZSCORE', queue, rid) then
    local base = ARGV[2] .. ':{' .. rid .. '}:'
    local job = redis.call('GET', base .. 'job')
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    out[#out + 1] = {rid, queue, last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0,
                     job and string.match(job, '"et":(%d+)}$') or '0', redis.call('EXISTS', base .. 'cancel')}
  else
    redis.call('ZREM', KEYS[1], member)
  end
end
return out
"""

# Extends leases still held by their run. KEYS: none. ARGV: lease ms, prefix, then rid, token, rid, token...
# Returns 1 (extended) or 0 (lost) per job.
REFRESH = """
local out = {}
for i = 3, #ARGV, 2 do
  local lease = ARGV[2] .. ':{' .. ARGV[i] .. '}:lease'
  if redis.call('GET', lease) == ARGV[i + 1] then
    out[#out + 1] = redis.call('PEXPIRE', lease, ARGV[1])
  else
    out[#out + 1] = 0
  end
end
return out
"""

# Moves queue entries no worker can run aside: out of the queue, onto the dead-letter list (bounded, with a
# TTL). KEYS: queue, dead letters. ARGV: most kept, TTL s, then entry, record, entry, record...
# Returns how many entries were still queued.
REJECT = """
local moved = 0
for i = 3, #ARGV, 2 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    moved = moved + 1
    redis.call('LPUSH', KEYS[2], ARGV[i + 1])
  end
end
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[1]) - 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return moved
"""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script called by SHA (loaded on first use, and again after a Redis restart emptied the cache)."""

    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> Script:
        return cls(source, hashlib.sha1(source.encode()).hexdigest())

    async def run(self, redis: Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            await redis.script_load(self.source)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
