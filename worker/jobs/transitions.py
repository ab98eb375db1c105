"""A job's transitions: each one atomic Redis call (a Lua script, here beside the typed call that makes it).

    queued ──claim──▶ running ──end──▶ ended    (exactly one terminal event: done or error)
      ▲ │                │                 ▲
      │ └───lapse────────┼─────────────────┘    (expired while queued: error(expired))
      └───hand back──────┘                      (a reset event: shutdown, or the reaper after a worker died)

- **claim** (``CLAIM``): a worker claims due jobs of its queues in one call, lowest score first, each queue up
  to its engine's room. Each takes a lease whose token names the run (``<worker id>:<try>``); only here is the
  try counted, so tries count runs that started.
- **append / end / hand back** (``EMIT``): a run's events, one call per engine step for all the worker's jobs;
  the terminal event's call also ends the job, a reset's hands it back to its queue.
- **refresh** (``REFRESH``): extends a worker's leases; a run whose lease is gone is fenced: it writes nothing more.
- **reap** (``SWEEP``, then ``EMIT`` as the empty owner): a running job whose lease expired (its worker died or
  froze) is handed back with a reset, or ended on its last try.
- **lost data** (``EMIT``, write ``LOST``): Redis lost its data under a running job (the epoch changed, the
  record is gone): the run ends it ``error(data_lost)``, retryable, instead of leaving its followers waiting.
- **lapse** (``LAPSE``, then ``EMIT`` as the empty owner, write ``EXPIRE``): a job still queued past its expiry
  ends ``error(expired)``, or ``done(cancelled)`` if a cancel waits; taking it out of its queue decides a race
  with a worker claiming it.
- **reject** (``REJECT``): a queue entry no worker can run goes to the dead-letter list.

Each script checks in Redis that its caller may make the move: a run only while the job's lease holds that
run's token, the reaper only while nobody holds it and the job's log is where the reaper read it. A run that
lost its lease (paused, partitioned, reaped, or its job finished elsewhere) can therefore change nothing about
the job, whenever it wakes up. :class:`Transitions` changes no run: the run table (worker/jobs/table.py)
decides each job's moves and sends its EMIT calls.

A job's keys are named in the scripts from the prefix and its id, as ``api.keys.Keys`` names them
(``<prefix>:{<id>}:lease`` and so on), rather than passed as KEYS: redis-py packs every argument in Python, on
the event loop that shares the GIL with the engine, so a step's records travel as one argument. (So the
scripts are not Redis Cluster-ready.)
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from mlxq.api import history
from mlxq.api.jobrecord import result_record
from mlxq.api.keys import DONE_TTL_S, LIVE_TTL_S, Keys
from mlxq.api.schema import PRIORITY_MIN, Event, decode_event
from mlxq.api.tenants import LUA_QUEUE_OF, SHARE_TTL_S

from .run import Run, Wire

__all__ = ["Affinity", "BelowShare", "Due", "DueEntry", "EntryStatus", "Lapsed", "LogTTL", "Lost", "Outranking",
           "Record", "Script", "Transitions", "Write"]

_LAPSED_PER_SWEEP = 500
_READ_MIN = 16  # due entries CLAIM reads per queue, at least (poison and deferred entries may come first)
_EPOCH_TTL_S = 7 * 86_400  # refreshed at every claim
# A run's token appends set its log's TTL (LogTTL.live) this many times a TTL, not on every append
_LOG_TTL_REFRESHES = 10
_APPENDS_PER_READ = 256  # token appends whose leases EMIT reads in one MGET (within Lua's unpack limit)
_TRIES_TTL_S = 86_400  # a job's record lives at most this long too (api.client.JOB_TTL_MS)
_DEAD_LETTERS_KEPT = 1000
_DEAD_LETTER_TTL_S = 7 * 86_400


class Write(enum.Enum):
    """What an EMIT call does with a job beyond logging and publishing its events."""

    APPEND = "a"
    END = "e"
    HAND_BACK = "h"
    LOST = "l"
    EXPIRE = "x"


class EntryStatus(enum.Enum):
    """What CLAIM did with one due queue entry."""

    STARTED = "started"
    DEFERRED = "deferred"  # another run still holds its lease: left queued, due later, no try counted
    GONE = "gone"  # queued, but its record is gone (expired or lost): for REJECT
    POISON = "poison"  # the queue entry is no job id a producer makes: for REJECT


class Affinity(enum.Enum):
    """How CLAIM's prefix affinity placed a started job (one with an affinity key): on a worker whose prefix cache
    holds its key, elsewhere once it waited past the bound for the live one that does, or where no live worker held
    it."""

    HOLDER = "holder"
    ELSEWHERE = "elsewhere"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class LogTTL:
    """Replay-log TTLs, and how long arq's result record of an ended job is kept (0: none); seconds."""

    live: int = LIVE_TTL_S
    done: int = DONE_TTL_S
    result: int = 0


@dataclass(frozen=True, slots=True)
class DueEntry:
    """One due queue entry, as CLAIM left it; ``job``, ``attempt``, ``last`` and ``cancelled`` only when started."""

    rid: str
    queue: str
    status: EntryStatus
    epoch: str
    entry: bytes = b""  # the queue entry as stored (a poison one may not be text)
    job: bytes = b""
    attempt: int = 0
    last: Event | None = None  # the job's last logged event (an earlier run's)
    cancelled: bool = False
    affinity: Affinity | None = None  # None: affinity did not place it (no key, affinity off, or outranking)


@dataclass(frozen=True, slots=True)
class Outranking:
    """What a queued job needs for a full engine to take it: at least ``priority`` (it then starts at once,
    preempting a running sequence of lower priority). A job of lower priority that only waited long is left
    for room: once claimed it would preempt nobody."""

    priority: int
    aging_ms: int
    count: int = 1  # jobs that would start at once: one per running sequence of the lowest priority

    def arg(self) -> str:
        """As CLAIM takes it (it recovers a queued job's priority from its score: ``api.keys.queue_score``)."""
        return f"{self.priority} {self.aging_ms} {PRIORITY_MIN}"


@dataclass(frozen=True, slots=True)
class BelowShare:
    """What a queued job's tenant must be for a full engine to take it: below its share of the batch
    (engine/shares.py), its load there once the job runs, (running there + 1) ÷ its weight, at most ``spare``
    (the most loaded running tenant's load less one job); it then starts at once in that tenant's place.
    ``running``: each tenant's jobs running in that engine."""

    spare: float
    running: dict[str, int]

    def arg(self) -> str:
        """As CLAIM takes it: "<spare> <tenant> <running> ..." (a tenant's name has no space)."""
        return " ".join([repr(self.spare), *(f"{t} {n}" for t, n in self.running.items())])


@dataclass(frozen=True, slots=True)
class Due:
    """What one CLAIM call did: an entry per due queue entry it looked at, and whether it left due jobs queued."""

    entries: list[DueEntry]
    left: bool


@dataclass(frozen=True, slots=True)
class Lost:
    """A running job whose lease expired, as SWEEP read it."""

    rid: str
    queue: str
    next_seq: int
    tries: int
    has_record: bool


@dataclass(frozen=True, slots=True)
class Lapsed:
    """A queued job whose expiry passed, as LAPSE read it."""

    rid: str
    queue: str
    next_seq: int
    enqueue_ms: int  # 0 if its record is gone
    cancelled: bool


@dataclass(frozen=True, slots=True)
class Record:
    """One job's events for an EMIT call, and what the call does with the job."""

    run: Run
    events: Sequence[Wire]
    write: Write


# --- the scripts, in the order of the calls below ----------------------------------------------------------
# Tenants (api/tenants.py): a model's jobs wait on one queue per tenant (api.keys.Keys.queue; KEYS name the
# default tenant's, arq's queue), and ``<prefix>:backlog:<model>`` lists the tenants that may have some queued.
# The fair share (start-time fair queuing over work, as VTC): each (model, tenant) has a virtual work account in
# ``<prefix>:share:<model>``: tokens (prompt + generated) of its ended jobs ÷ its weight, charged when a job ends
# (EMIT). A claim serves the backlogged tenant with the least virtual work, counting its running jobs at its mean
# work per job (so a burst of starts spreads by weight before any of them ends); a tenant back from idle (ENQUEUE
# adds it to the backlog again) is lifted to ``~floor``, the least virtual work among the backlogged at the last
# claim: no credit for idle time. A tenant at its ``max_running``
# (fleet-wide, ``<prefix>:tenants:running``) or its ``tokens_per_minute`` (``<prefix>:tpm:<tenant>:<minute>``)
# is passed over: its jobs wait. The cost grows with the backlogged tenants, never with the queued jobs.
_SHARE_LUA = LUA_QUEUE_OF + r"""
local function model_tenant(P, queue)  -- the model and tenant of a queue name (api.keys.Keys.queue_of)
  local tq = P .. ':tqueue:'
  if string.sub(queue, 1, #tq) == tq then
    local rest = string.sub(queue, #tq + 1)
    local colon = string.find(rest, ':', 1, true)
    if colon then return string.sub(rest, colon + 1), string.sub(rest, 1, colon - 1) end
    return nil, nil
  end
  local q = P .. ':queue:'
  if string.sub(queue, 1, #q) == q then return string.sub(queue, #q + 1), 'default' end
  return nil, nil
end
local function share_left(P, queue, ttl, later)  -- a running job left (ended or handed back): count it out
  -- (later: the caller writes the share hash again and sets its TTL then)
  local model, tenant = model_tenant(P, queue)
  if not model then return nil, nil, nil end
  local share, running = P .. ':share:' .. model, P .. ':tenants:running'
  -- a count that reaches 0 goes: idle, the accounts leave nothing behind
  for _, field in ipairs({tenant .. ':r', '~r'}) do
    if redis.call('HINCRBY', share, field, -1) <= 0 then redis.call('HDEL', share, field) end
  end
  if redis.call('HINCRBY', running, tenant, -1) <= 0 then redis.call('HDEL', running, tenant) end
  if not later then redis.call('EXPIRE', share, ttl) end
  redis.call('EXPIRE', running, ttl)
  return model, tenant, share
end
"""

# queued -> running, from several models' queues in one call. For each model queue whose quota is above 0, its
# backlogged tenants' due entries (see above); then start, one at a time, each model's next job from its tenant
# with the least virtual work (lowest score first within a tenant), taking across models the one of lowest
# score, up to each model's quota and ARGV[2] in all: takes the lease with token "<worker id>:<try>", counts the
# try (only here: a try is a run that started), lists the job as running (value "<score> <queue>", so a
# hand-back can queue it in its old place), counts it running for its tenant, and takes it out of its queue and
# its deadline. A job whose lease another run still holds stays queued, due a lease TTL later, with no try
# counted. An entry that is no job id (not what a producer makes: wrong bytes or length) comes back as poison,
# one without a job record as gone: both for REJECT. Also reads the deployment's epoch (setting it if Redis has
# none: a fresh or emptied server), each started job's last logged event, and whether a cancel is pending; and
# whether due jobs were left queued (for lack of quota, a tenant's cap, or beyond the read limit).
# KEYS: running, epoch, deadlines, then the models' (default tenant's) queues. ARGV: now ms, most, worker id,
# lease ms, prefix, a new epoch, epoch TTL s, tries TTL s, read limit per tenant queue, then one quota per queue,
# then per queue "" or what a job needs to outrank a full engine's running sequences, "<priority> <aging ms>
# <PRIORITY_MIN>": from such a queue only the first jobs (up to its quota) of at least that priority are read,
# each one's priority recovered from its score and its record's enqueue time (records end with "et":<ms>}:
# api.jobrecord.job_record; GETRANGE reads only that tail), among the first _OUTRANK_READ entries that could
# have them (api.keys.queue_score: never above enqueue time); then the share TTL s, the mean work per job assumed
# before a tenant's first job ends; then the affinity wait ms (< 0: affinity off; see _AFFINITY_LUA above); then
# (fair share across tenants, apart from the rest) per queue "" or what a tenant must be for a full engine to take
# its job (BelowShare.arg): from such a queue only tenants below their share there are read as usual (the others,
# by priority as above if the queue has a priority need, or not at all).
# Returns {epoch, left 0|1, {id, queue, "started", score, job, try, last event or false, cancelled 0|1,
# affinity "holder" | "elsewhere" | "none" | "" | "?" (nobody holds a key: "none" if the job has one)} |
# {id, queue, "deferred" | "gone" | "poison"}, ...}.
# Its cost with one tenant and no advertiser, beyond the jobs' own reads and writes: the backlog, the model's
# share account and the tenant's policy (one read each), and per tenant queue one write each of the running
# list, the queue, the deadlines and the three running counts (not one per started job); their hashes' TTLs
# only where a count starts from none (a running count's TTL is set again by each of its jobs' ends).
_OUTRANK_READ = 128  # queue entries CLAIM looks through for a job that outranks a full engine
_MEAN_WORK = 256  # tokens a tenant's job is assumed to cost before one of its jobs ends

# Prefix affinity (api/affinity.py, worker/affinity.py): which of a tenant's read entries CLAIM takes next
# (``head``), in place of simply its first. A job record's tail holds its affinity key ("ak":"<hex>", before
# "et"); each worker advertises the keys its prefix cache holds, per model, in the set
# ``<prefix>:affkeys:<model>:<worker>``, and itself in ``<prefix>:affholders:<model>`` scored by when that
# advertisement lapses (ms): a holder is live until then. A holder whose engine is full is also in
# ``<prefix>:afffull:<model>`` (scored the same way, written only when it fills or frees, rate-limited): its keys'
# jobs do not wait for it. An entry is "mine" (this worker holds its key), "wait" (another live worker that is
# not full holds it and it became due less than the wait ago: skipped, left queued), "elsewhere" (another holds
# it, but it waited past the bound, or every other holder is full), "none" (a key nobody live holds) or "" (no
# key, or affinity off: ARGV wait < 0, no worker advertises for the model, or jobs read to outrank a full engine,
# which start at once). A "none" job also waits (at most as long) while another live advertiser that is not full
# holds fewer keys than this worker: the keys spread over the fleet, and with them the conversations' work.
# ``head`` takes the first entry not skipped, unless a "mine" one of at least its priority (the lead of its score
# below its enqueue time: api.keys.queue_score) is among the entries read: priority, the tenants' shares and the
# read limit stand; only the order within a tenant's read entries changes. Costs: one ZRANGE of the advertisers,
# one GETRANGE per entry looked at, one SCARD per live advertiser, one ZRANGEBYSCORE of the full ones (when
# others advertise), one SISMEMBER per live advertiser and distinct key; no GETRANGE while no live worker
# advertises a key for the model (an advertiser holding none holds no job's key).
_AFFINITY_LUA = r"""
local affinity_wait = tonumber(ARGV[12 + 2 * queues]) or -1
local function holders(m)  -- this worker's key set (if it advertises), the other live holders' sets, and
  -- whether one of them holds fewer keys than this worker (then it is the one to take a job nobody holds)
  if m.holders then return m.holders end
  local h = {mine = false, others = {}, seen = {}, fewer = false}
  m.holders = h
  if affinity_wait < 0 then return h end
  local zkey = P .. ':affholders:' .. m.model
  local listed = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')  -- one read while nobody's advertisement lapsed
  local live, lapsed = {}, false
  for i = 1, #listed, 2 do
    if tonumber(listed[i + 1]) <= now then lapsed = true else live[#live + 1] = listed[i] end
  end
  if lapsed then redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now) end  -- dead, frozen or stopped
  local full = {}
  if #live > 1 or (#live == 1 and live[1] ~= ARGV[3]) then  -- others advertise: which are full
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', P .. ':afffull:' .. m.model, now, '+inf')) do
      full[w] = true
    end
  end
  local mine_n, fewest = 0, nil
  for _, w in ipairs(live) do
    local set = P .. ':affkeys:' .. m.model .. ':' .. w
    local n = redis.call('SCARD', set)
    if w == ARGV[3] then
      h.mine, mine_n = n > 0 and set, n  -- an empty set holds no key: no entry is "mine"
    else
      h.others[#h.others + 1] = {set, full[w] or false}
      if not full[w] and (not fewest or n < fewest) then fewest = n end
    end
  end
  h.fewer = h.mine and fewest ~= nil and fewest < mine_n
  return h
end
local function affinity(m, s, e)  -- the entry's class (see above), computed once per call
  if e.aff then return e.aff end
  local h = holders(m)
  if s.urgent or (not h.mine and #h.others == 0) then return '' end  -- placed as ever (took() tells if keyed)
  local tail = redis.call('GETRANGE', P .. ':{' .. e[1] .. '}:job', -64, -1)
  local et = tonumber(string.match(tail, '"et":(%d+)}$'))
  e.aff, e.lead = '', et and et - e[2] or -math.huge  -- no record (gone, poison): any job may go first
  local ak = string.match(tail, '"ak":"(%x+)","et":%d+}$')
  if not ak then return e.aff end
  local held = h.seen[ak]
  if held == nil then
    held = 'none'
    if h.mine and redis.call('SISMEMBER', h.mine, ak) == 1 then
      held = 'mine'
    else
      for _, o in ipairs(h.others) do  -- a full holder's key: taken elsewhere at once, unless another holds it
        if redis.call('SISMEMBER', o[1], ak) == 1 then
          if not o[2] then held = 'theirs'; break end
          held = 'full'
        end
      end
    end
    h.seen[ak] = held
  end
  -- a job another live worker holds waits for it, one nobody holds for the live worker holding the fewest keys
  -- (so conversations spread over the fleet), from when it became due: enqueued, or deferred to its score
  if held == 'theirs' or (held == 'none' and h.fewer) then
    local waiting = now - math.max(et, e[2]) < affinity_wait
    held = waiting and 'wait' or (held == 'theirs' and 'elsewhere' or 'none')
  elseif held == 'full' then
    held = 'elsewhere'
  end
  e.aff = held
  return held
end
local function head(m, s)  -- the index of the entry CLAIM takes next from tenant s, or nil
  if s.pick ~= nil then return s.pick or nil end
  local first = nil
  local h = holders(m)
  for i = s.pos, #s.entries do
    local e = s.entries[i]
    if not e.done then
      local class = affinity(m, s, e)
      if class == 'mine' and (not first or e.lead >= s.entries[first].lead) then first = i; break end
      if class ~= 'wait' and not first then
        first = i
        if not h.mine then break end  -- holding nothing, no later entry is preferred
      end
    end
  end
  s.pick = first or false
  return first
end
local function took(s, e)  -- the entry starts (or is deferred/rejected): the next head is looked for again
  e.done, s.pick = true, nil
  while s.pos <= #s.entries and s.entries[s.pos].done do s.pos = s.pos + 1 end
  if e.aff == nil and affinity_wait >= 0 and not s.urgent then  -- nobody advertises: a keyed job counts "none"
    e.aff = '?'  -- the caller tells from the job record it gets back (no GETRANGE here)
  end
  local outcome = e.aff or ''
  if outcome == 'mine' then outcome = 'holder' end
  return outcome
end
"""

_CLAIM = _SHARE_LUA + """
local P = ARGV[5]
local epoch = redis.call('GET', KEYS[2])
if not epoch then epoch = ARGV[6] end
redis.call('SET', KEYS[2], epoch, 'EX', ARGV[7])
local now, most, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[9])
local queues = #KEYS - 3
local share_ttl, mean0 = ARGV[10 + 2 * queues], tonumber(ARGV[11 + 2 * queues])
local left = 0
local function is_job_id(id)  -- what a producer makes; anything else in a queue is poison
  return #id <= 64 and string.match(id, '^[%w_.:%-]+$') ~= nil
end
-- fair share across tenants: a full engine takes a job of a tenant below its share there (BelowShare)
local function below_share(arg)  -- {spare, running = {tenant = n}}, or nil
  local spare, rest = string.match(arg or '', '^(%S+)(.*)$')
  if not spare then return nil end
  local s = {spare = tonumber(spare), running = {}}
  for t, n in string.gmatch(rest, '(%S+) (%d+)') do s.running[t] = tonumber(n) end
  return s
end
local function outranking(key, need, aging, pmin, n)
  -- the first n queued jobs of priority >= need; score = enqueue - (priority - pmin) * aging
  local lead = (need - pmin) * aging  -- how far below its enqueue time such a job's score is, at least
  local entries = redis.call('ZRANGEBYSCORE', key, '-inf', now - lead, 'WITHSCORES', 'LIMIT', 0, OUTRANK_READ)
  local found = {}
  for i = 1, #entries, 2 do
    if #found >= n then break end
    local id, score = entries[i], tonumber(entries[i + 1])
    if is_job_id(id) then
      local tail = redis.call('GETRANGE', P .. ':{' .. id .. '}:job', -32, -1)
      local et = tonumber(string.match(tail, '"et":(%d+)}$'))
      if et and et - score >= lead then found[#found + 1] = {id, score} end
    end
  end
  return found, redis.call('ZCOUNT', key, '-inf', now) > #found
end
local running = {}  -- each tenant's jobs running fleet-wide, as counted, plus this call's starts
local policies = {}
local minute = math.floor(now / 60000)
local function policy(t)  -- {weight, max running, tokens per minute}
  local p = policies[t]
  if not p then
    local v = redis.call('HMGET', P .. ':tenant:' .. t, 'weight', 'max_running', 'tokens_per_minute')
    p = {tonumber(v[1]) or 1, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
    if p[1] <= 0 then p[1] = 1 end
    running[t] = 0  -- read only where a cap needs it
    if p[2] > 0 then running[t] = tonumber(redis.call('HGET', P .. ':tenants:running', t) or '0') end
    if p[3] > 0 then  -- the last minute's tokens: this minute's, and the previous minute's part still inside
      local cur = tonumber(redis.call('GET', P .. ':tpm:' .. t .. ':' .. minute) or '0')
      local prev = tonumber(redis.call('GET', P .. ':tpm:' .. t .. ':' .. (minute - 1)) or '0')
      p[4] = cur + prev * (1 - (now % 60000) / 60000) >= p[3]
    end
    policies[t] = p
  end
  return p
end
local function capped(t)
  local p = policy(t)
  return (p[2] > 0 and running[t] >= p[2]) or p[4] == true
end
local function below(s, t)  -- t's load in that engine once its job runs there is at most the spare load
  return ((s.running[t] or 0) + 1) / policy(t)[1] <= s.spare
end
-- models[q] = {share key, floor, tenants = {{t, key, entries, pos, vt, run, mean, weight}, ...}}
local models = {}
for q = 4, #KEYS do
  local quota = tonumber(ARGV[6 + q])
  local model = string.sub(KEYS[q], #P + 8)
  local backlog = P .. ':backlog:' .. model
  local m = {share = P .. ':share:' .. model, tenants = {}, quota = quota, model = model}
  models[q] = m
  local names, seen = {'default'}, {default = true}
  local members = redis.call('SMEMBERS', backlog)
  for _, t in ipairs(members) do
    if not seen[t] then seen[t] = true; names[#names + 1] = t end
  end
  m.backlogged = #members  -- the backlog's size as this call leaves it (EXISTS without a call)
  -- the model's floor and running count, and the default tenant's account (the one read with one tenant)
  local acct = redis.call('HMGET', m.share, '~floor', '~r', 'default', 'default:r', 'default:a')
  m.floor, m.running, m.default = tonumber(acct[1]) or 0, acct[2] ~= false, {acct[3], acct[4], acct[5]}
  local fs = below_share(ARGV[9 + 2 * queues + q])
  -- (the backlogged tenants' queues are read below; a model with none queued and none running forgets its
  -- accounts: nobody is owed anything, and nothing is left behind in Redis)
  local function gone(t, key)  -- no due entry read: is its queue gone? (then it leaves the backlog)
    if redis.call('EXISTS', key) == 0 then
      m.backlogged = m.backlogged - redis.call('SREM', backlog, t)
      return true
    end
    return false
  end
  for _, t in ipairs(names) do
    local key = queue_of(P, model, t)
    if quota <= 0 or capped(t) or (fs and not below(fs, t) and ARGV[6 + q + queues] == '') then
      -- no quota, capped, or at or above its share in a full engine
      if redis.call('ZCOUNT', key, '-inf', now) > 0 then left = 1 else gone(t, key) end
    else
      local entries, more = {}, false
      local need, aging, pmin = string.match(ARGV[6 + q + queues], '^(%-?%d+) (%d+) (%-?%d+)$')
      if need and not (fs and below(fs, t)) then
        entries, more = outranking(key, tonumber(need), tonumber(aging), tonumber(pmin), quota)
      else
        local n = limit
        if fs and below(fs, t) then  -- a full engine takes only the jobs that keep it within its share there
          n = math.max(1, math.floor(fs.spare * policy(t)[1] - (fs.running[t] or 0) + 1e-9))
        end
        local raw = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, n)
        more = #raw >= 2 * n
        for i = 1, #raw, 2 do entries[#entries + 1] = {raw[i], tonumber(raw[i + 1])} end
      end
      if more then left = 1 end
      if #entries > 0 then
        local acct = t == 'default' and m.default or redis.call('HMGET', m.share, t, t .. ':r', t .. ':a')
        m.tenants[#m.tenants + 1] = {t = t, key = key, entries = entries, pos = 1, vt = tonumber(acct[1]) or 0,
          run = tonumber(acct[2]) or 0, mean = tonumber(acct[3]) or mean0, weight = policy(t)[1],
          urgent = need ~= nil, ids = {}, rows = {}, members = {}}
      elseif not more then
        gone(t, key)
      end
    end
  end
end
for q = 4, #KEYS do
  if models[q].backlogged <= 0 and not models[q].running then
    redis.call('DEL', models[q].share)
  end
end
for q = 4, #KEYS do  -- the least virtual work among the backlogged: where a tenant back from idle starts
  local m, low = models[q], nil
  for _, s in ipairs(m.tenants) do
    if not low or s.vt < low then low = s.vt end
  end
  if low and low > m.floor then
    redis.call('HSET', m.share, '~floor', string.format('%.17g', low))
    redis.call('EXPIRE', m.share, share_ttl)
  end
end
local function fair(s)  -- a tenant's virtual work, its running jobs counted at its mean work per job
  return s.vt + s.run * s.mean / s.weight
end
AFFINITY
local function next_of(m)  -- the model's next job: from its tenant with the least virtual work
  local best, key
  for _, s in ipairs(m.tenants) do
    if head(m, s) and not capped(s.t) then
      local k = fair(s)
      if not best or k < key or (k == key and s.entries[head(m, s)][2] < best.entries[head(m, best)][2]) then
        best, key = s, k
      end
    end
  end
  return best
end
local out = {epoch, 0}
local started, taken = 0, {}
while true do
  local pick, pq
  for q = 4, #KEYS do  -- across models: the lowest score (it orders by priority and enqueue time)
    local m = models[q]
    if (taken[q] or 0) < m.quota then
      local s = next_of(m)
      if s and (not pick or s.entries[head(m, s)][2] < pick.entries[head(models[pq], pick)][2]) then
        pick, pq = s, q
      end
    end
  end
  if not pick or started >= most then break end
  local m = models[pq]
  local entry = pick.entries[head(m, pick)]
  local id, score = entry[1], entry[2]
  local queue = pick.key
  local outcome = took(pick, entry)
  if not is_job_id(id) then
    out[#out + 1] = {id, queue, 'poison'}
  else
    local base = P .. ':{' .. id .. '}:'
    local job, tries, cancel = unpack(redis.call('MGET', base .. 'job', base .. 'tries', base .. 'cancel'))
    if not job then
      out[#out + 1] = {id, queue, 'gone'}
    else
      local try = tonumber(tries or '0') + 1
      if redis.call('SET', base .. 'lease', ARGV[3] .. ':' .. try, 'NX', 'PX', ARGV[4]) then
        started = started + 1
        taken[pq] = (taken[pq] or 0) + 1
        redis.call('SET', base .. 'tries', try, 'EX', ARGV[8])
        -- listed running, out of its queue and deadlines: written after the loop, once per tenant queue
        pick.ids[#pick.ids + 1] = id
        pick.rows[#pick.rows + 1] = id
        local listed = string.format('%d', score)
        pick.rows[#pick.rows + 1] = listed .. ' ' .. queue
        pick.members[#pick.members + 1] = id .. '@' .. queue
        pick.run = pick.run + 1  -- counted at once for this call's next picks (the caps, the shares)
        running[pick.t] = running[pick.t] + 1
        local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
        out[#out + 1] = {id, queue, 'started', listed, job, try, last and last[2][2] or false,
                         cancel and 1 or 0, outcome}
      else
        redis.call('ZADD', queue, now + tonumber(ARGV[4]), id)
        out[#out + 1] = {id, queue, 'deferred'}
      end
    end
  end
end
local function each(cmd, key, list)  -- one call per 512 arguments (Lua's stack bounds unpack); the replies' sum
  local n = 0
  for i = 1, #list, 512 do n = n + redis.call(cmd, key, unpack(list, i, math.min(i + 511, #list))) end
  return n
end
local counted = false
for q = 4, #KEYS do  -- due jobs left behind: for lack of quota, a cap, the read limit, or another's affinity
  local m = models[q]
  for _, s in ipairs(m.tenants) do
    if s.pos <= #s.entries then left = 1 end
    if #s.ids > 0 then  -- its started jobs: running (counted once each: a job already listed is not again)
      local new = each('HSET', KEYS[1], s.rows)
      each('ZREM', s.key, s.ids)
      each('ZREM', KEYS[3], s.members)
      if new > 0 then
        -- a count that starts here may have made its hash: it expires (once, below); a count running already
        -- leaves the TTL as is (each of its jobs' end or hand-back sets it again, as EMIT and SWEEP count out)
        if redis.call('HINCRBY', m.share, s.t .. ':r', new) == new then m.counted = true end
        if redis.call('HINCRBY', m.share, '~r', new) == new then m.counted = true end
        if redis.call('HINCRBY', P .. ':tenants:running', s.t, new) == new then counted = true end
      end
    end
  end
  if m.counted then redis.call('EXPIRE', m.share, share_ttl) end
end
if counted then redis.call('EXPIRE', P .. ':tenants:running', share_ttl) end
out[2] = left
return out
""".replace("OUTRANK_READ", str(_OUTRANK_READ)).replace("AFFINITY", _AFFINITY_LUA, 1)

# running -> running | ended | queued, and queued -> ended (expired), for several jobs in one call (one round
# trip per engine step).
# KEYS: running, epoch, deadlines. ARGV: record count, live TTL s, done TTL s, now ms, prefix, result TTL ms, every
# record in one argument (each "<size>\n<record>"), share TTL s, job TTL ms, then the token appends: rid, owner,
# entry id ("<seq>-1"), event, rid, owner, ... (a run's one-event appends while its log's TTL is fresh: N per engine
# step, so they skip the records' parsing, the EXPIRE and a GET each; written as an "a" record is). A record is a
# line "<queue bytes> <rid bytes> <owner bytes> <write> <first seq> <result bytes>", then queue, rid, owner and
# result back to back, a newline, and its events (JSON texts, which never hold a raw newline) joined by newlines;
# event i is logged as entry "<first seq + i>-1" and published on the job's channel.
# The caller may write if (by write): a/e/h: owner is a run's token and the lease holds it, or owner is ""
# (the reaper) and nobody holds the lease, the job is listed as running, and its log's next seq is the
# record's first (two reapers cannot both act on one job); l: owner is the epoch the run started in and the
# epoch moved on (Redis lost its data since) and the job record is gone; x: owner is "" and the job is still
# queued (taking it out of its queue decides) and its log's next seq is the record's first.
# Writes: a: append. e: end: drop lease, running entry, cancel key, job record, tries and queue entry, keep
# the result (if any) for the result TTL and the log for the done TTL; its tenant's running count drops, and a
# done event's usage (prompt + generated tokens) is charged to its tenant's fair-share account (÷ its weight),
# mean work per job and tokens of this minute. h: hand back: drop lease and running entry (and the running
# count), queue the job again in its old place (the score CLAIM listed it with), due at once, its tenant
# backlogged again. l: append, log kept for the done TTL. x: as e, and the job's deadline is dropped. e and x
# also add the ended job to its model's history and the recent list (_HISTORY).
# Returns 1 (written) or 0 (refused) per record, then per token append. An entry id already logged (a duplicate) is
# not published.
_EMIT = _SHARE_LUA + r"""
HISTORY
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
    local final
    for event in string.gmatch(string.sub(rec, h + lq + lr + lo + lres + 2), '[^\n]+') do
      final = event
      local r = redis.pcall('XADD', log, seq .. '-1', 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', channel, event)
      end
      seq = seq + 1
    end
    if (write == 'e' or write == 'x') and final then history(queue, rid, owner, final) end
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
    if (write == 'e' or write == 'h') and redis.call('HDEL', KEYS[1], rid) == 1 then
      local pt, ct = string.match(final or '', '"usage":{"prompt_tokens":(%d+),"completion_tokens":(%d+)}')
      local charge = write == 'e' and pt ~= nil
      local model, tenant, share = share_left(ARGV[5], queue, ARGV[8], charge)
      if model and charge then  -- charge its work: fair share, mean work, tokens per minute
        local work = tonumber(pt) + tonumber(ct)
        local weight = tonumber(redis.call('HGET', ARGV[5] .. ':tenant:' .. tenant, 'weight') or '1') or 1
        if weight <= 0 then weight = 1 end
        local acct = redis.call('HMGET', share, tenant, tenant .. ':a')  -- one read, one write (the script is atomic)
        local mean = tonumber(acct[2] or '')
        redis.call('HSET', share, tenant, string.format('%.17g', (tonumber(acct[1] or '') or 0) + work / weight),
                   tenant .. ':a', string.format('%.17g', mean and 0.8 * mean + 0.2 * work or work))
        redis.call('EXPIRE', share, ARGV[8])
        local bucket = ARGV[5] .. ':tpm:' .. tenant .. ':' .. math.floor(tonumber(ARGV[4]) / 60000)
        if redis.call('INCRBY', bucket, work) == work then  -- new this minute: its TTL once (it outlives its read)
          redis.call('EXPIRE', bucket, 120)
        end
      end
      if model and write == 'h' then
        redis.call('SADD', ARGV[5] .. ':backlog:' .. model, tenant)
        redis.call('EXPIRE', ARGV[5] .. ':backlog:' .. model, ARGV[9])
      end
    end
    if write == 'e' or write == 'h' then
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
-- The token appends: a lease check, the log entry and its publish; nothing to parse, the log's TTL left as is.
local n = #out
for from = 10, #ARGV, 4 * APPENDS_PER_READ do  -- the leases read APPENDS_PER_READ at a time: one MGET each
  local last = math.min(#ARGV, from + 4 * APPENDS_PER_READ - 1)
  local bases, leases = {}, {}
  for i = from, last, 4 do
    local base = ARGV[5] .. ':{' .. ARGV[i] .. '}:'
    bases[#bases + 1] = base
    leases[#leases + 1] = base .. 'lease'
  end
  local held = redis.call('MGET', unpack(leases))
  for k, base in ipairs(bases) do
    local i = from + 4 * (k - 1)
    n = n + 1
    if held[k] == ARGV[i + 1] then
      local event = ARGV[i + 3]
      local r = redis.pcall('XADD', base .. 'log', ARGV[i + 2], 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', base .. 'events', event)
      end
      out[n] = 1
    else
      out[n] = 0
    end
  end
end
return out
"""

# The history a job's end adds (api.history): its model's time bucket (jobs, errors, tokens, histograms of TTFT
# and queue wait) and its summary on the recent list; once per job, never per token. ARGV[4]: now ms, ARGV[5]:
# prefix.
_HISTORY = r"""
local EDGES = HIST_EDGES
local function bin(ms)
  for i, edge in ipairs(EDGES) do if ms <= edge then return i - 1 end end
  return #EDGES - 1
end
local function num(v) if type(v) == 'number' then return v end return nil end
local function history(queue, rid, owner, text)
  local okd, ev = pcall(cjson.decode, text)
  if not okd or type(ev) ~= 'table' then return end
  local model, tenant = model_tenant(ARGV[5], queue)  -- a tenant's queue names its model too
  if not model then return end
  local now = tonumber(ARGV[4])
  local key = ARGV[5] .. ':hist:' .. model .. ':' .. math.floor(now / (1000 * BUCKET_S))
  local t = type(ev.timings) == 'table' and ev.timings or {}
  local u = type(ev.usage) == 'table' and ev.usage or {}
  local ttft, wait, tokens = num(t.ttft_ms), num(t.queue_ms), num(u.completion_tokens) or 0
  local first = redis.call('HINCRBY', key, 'n', 1) == 1  -- a new bucket: its TTL once (it outlives its window)
  if ev.type == 'error' then redis.call('HINCRBY', key, 'err', 1) end
  if tokens > 0 then redis.call('HINCRBY', key, 'tok', tokens) end
  if ttft then redis.call('HINCRBY', key, 't' .. bin(ttft), 1) end
  if wait then redis.call('HINCRBY', key, 'w' .. bin(wait), 1) end
  if first then redis.call('EXPIRE', key, HISTORY_TTL) end
  local summary = cjson.encode({id = rid, model = model, tenant = tenant, type = ev.type,
    reason = ev.finish_reason or ev.code or '', ttft_ms = ttft or false, queue_ms = wait or false,
    total_ms = num(t.total_ms) or false, prompt_tokens = num(u.prompt_tokens) or false,
    completion_tokens = num(u.completion_tokens) or false, at_ms = now,
    worker = string.match(owner, '^(.*):%d+$') or ''})
  if redis.call('LPUSH', ARGV[5] .. ':recent', summary) > RECENT_KEPT then  -- one over: trimmed back
    redis.call('LTRIM', ARGV[5] .. ':recent', 0, RECENT_KEPT - 1)
  end
  redis.call('EXPIRE', ARGV[5] .. ':recent', RECENT_TTL)
end
""".replace("HIST_EDGES", history.lua_edges()).replace("BUCKET_S", str(history.BUCKET_S)).replace(
    "HISTORY_TTL", str(history.HISTORY_TTL_S)).replace("RECENT_KEPT", str(history.RECENT_KEPT)).replace(
    "RECENT_TTL", str(history.RECENT_TTL_S))
_EMIT = _EMIT.replace("HISTORY", _HISTORY, 1).replace("APPENDS_PER_READ", str(_APPENDS_PER_READ))

# Extends leases still held by their run. KEYS: none. ARGV: lease ms, prefix, then rid, token, rid, token...
# Returns 1 (extended) or 0 (lost) per job.
_REFRESH = """
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

# The reaper's read: every running job whose lease is gone. One whose log already ends with its terminal
# event only lost its bookkeeping: its running entry (and its tenant's running count) is dropped here. KEYS:
# running. ARGV: prefix, share TTL s.
# Returns {rid, queue, next seq, tries, 1 if its job record exists else 0, ...} for the others.
_SWEEP = _SHARE_LUA + """
local out = {}
local running = redis.call('HGETALL', KEYS[1])
for i = 1, #running, 2 do
  local rid = running[i]
  local base = ARGV[1] .. ':{' .. rid .. '}:'
  if redis.call('EXISTS', base .. 'lease') == 0 then
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    local kind = last and cjson.decode(last[2][2])['type']
    local queue = string.match(running[i + 1], '^%-?%d+ (.*)$') or running[i + 1]
    if kind == 'done' or kind == 'error' then
      redis.call('HDEL', KEYS[1], rid)
      share_left(ARGV[1], queue, ARGV[2])
    else
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
_LAPSE = """
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

# Moves queue entries no worker can run aside: out of the queue, onto the dead-letter list (bounded, with a
# TTL). KEYS: queue, dead letters. ARGV: most kept, TTL s, then entry, record, entry, record...
# Returns how many entries were still queued.
_REJECT = """
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


class Transitions:
    """The transitions of a worker's jobs (of any of its queues), as typed calls of their scripts."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, ttl: LogTTL, lease_ttl_s: float,
                 writer: Redis | None = None, affinity_wait_ms: int = -1) -> None:
        self.redis = redis
        self.writer = writer or redis  # EMIT calls' connection
        self.keys = keys
        self.worker_id = worker_id
        self.ttl = ttl
        self.lease_ms = int(lease_ttl_s * 1000)
        self.affinity_wait_ms = affinity_wait_ms  # how long a job waits for the live worker holding its prefix
        self._claim, self._emit, self._refresh = Script.of(_CLAIM), Script.of(_EMIT), Script.of(_REFRESH)
        self._sweep, self._lapse, self._reject = Script.of(_SWEEP), Script.of(_LAPSE), Script.of(_REJECT)

    async def open(self) -> None:
        """Set the deployment's epoch unless Redis has one (a fresh or emptied server); CLAIM keeps it."""
        await self.redis.set(self.keys.epoch(), uuid.uuid4().hex, nx=True, ex=_EPOCH_TTL_S)

    async def claim(self, quotas: dict[str, int], most: int, outranking: dict[str, Outranking] | None = None,
                    below_share: dict[str, BelowShare] | None = None) -> Due:
        """Claim up to ``most`` due jobs, lowest score first across the queues, each queue up to its quota;
        from a queue in ``outranking``, only jobs of at least its priority (up to its quota); from a queue in
        ``below_share``, jobs of the tenants below their share in its full engine (and the others' by priority,
        if it is in ``outranking`` too)."""
        queues = list(quotas)
        now = int(time.time() * 1000)
        outranking = outranking or {}
        needs = [outranking[q].arg() if q in outranking else "" for q in queues]
        fair = [below_share[q].arg() if below_share and q in below_share else "" for q in queues]
        args = [now, most, self.worker_id, self.lease_ms, self.keys.prefix, uuid.uuid4().hex,
                _EPOCH_TTL_S, _TRIES_TTL_S, max(_READ_MIN, 2 * most), *(quotas[q] for q in queues), *needs,
                SHARE_TTL_S, _MEAN_WORK, self.affinity_wait_ms, *fair]
        keys = [self.keys.running(), self.keys.epoch(), self.keys.deadlines(), *queues]
        epoch, left, *rows = await self._claim.run(self.redis, keys, args)
        return Due([_due_entry(row, epoch.decode()) for row in rows], bool(left))

    def run(self, entry: DueEntry, model: str, enqueue_ms: int) -> Run:
        """This worker's run of a job CLAIM started."""
        last = entry.last
        return Run(entry.rid, entry.queue, f"{self.worker_id}:{entry.attempt}", entry.attempt,
                   seq=last.seq + 1 if last is not None else 0, epoch=entry.epoch, model=model, enqueue_ms=enqueue_ms,
                   tenant=self.keys.queue_of(entry.queue)[1])

    async def write(self, records: Sequence[Record]) -> list[bool]:
        """One EMIT call: each record's events, and its write; whether each was allowed. Only the run table
        calls it, one call at a time."""
        now = time.monotonic()
        fresh = now - self.ttl.live / _LOG_TTL_REFRESHES  # a log whose TTL was set since needs none now
        general: list[Record] = []
        order: list[int] = []  # where each record's answer is: general ones first, then the token appends
        appends: list[object] = []
        for r in records:
            run = r.run
            if r.write is Write.APPEND and len(r.events) == 1 and run.owner and run.log_ttl_at > fresh:
                order.append(~(len(appends) // 4))
                rid, owner = run.wire_names()
                appends += (rid, owner, b"%d-1" % r.events[0].seq, r.events[0].model_dump_json())
            else:
                order.append(len(general))
                general.append(r)
        args: list[object] = [len(general), self.ttl.live, self.ttl.done, int(time.time() * 1000), self.keys.prefix,
                              max(1, self.ttl.result) * 1000]
        args.append(b"".join(b"%d\n%s" % (len(r), r) for r in map(self._record, general)))
        args += [SHARE_TTL_S, _TRIES_TTL_S * 1000, *appends]
        keys = [self.keys.running(), self.keys.epoch(), self.keys.deadlines()]
        result = await self._emit.run(self.writer, keys, args)
        for r, ok in zip(general, result):
            if ok == 1 and r.write is Write.APPEND:
                r.run.log_ttl_at = now  # it set the log's TTL
        return [result[i if i >= 0 else len(general) + ~i] == 1 for i in order]

    def _record(self, r: Record) -> bytes:
        run, events, write = r.run, r.events, r.write
        queue, rid = run.queue.encode(), run.rid.encode()
        owner = (run.epoch if write is Write.LOST else run.owner).encode()
        result = self._result(run, events[-1]) if write is Write.END and events else b""
        head = b"%d %d %d %s %d %d\n" % (len(queue), len(rid), len(owner), write.value.encode(),
                                         events[0].seq if events else run.seq, len(result))
        body = "\n".join(ev.model_dump_json() for ev in events).encode()
        return b"".join((head, queue, rid, owner, result, b"\n", body))

    def _result(self, run: Run, end: Wire) -> bytes:
        if self.ttl.result <= 0 or not run.owner:
            return b""
        return result_record(run.rid, attempt=run.attempt, ok=end.type == "done", event_json=end.model_dump_json(),
                             enqueue_ms=run.enqueue_ms, start_ms=int(run.started_at * 1000), queue=run.queue)

    async def refresh(self, runs: Sequence[Run]) -> list[bool]:
        """Extend the leases of ``runs``; whether each is still theirs."""
        args: list[object] = [self.lease_ms, self.keys.prefix]
        for run in runs:
            args += (run.rid, run.owner)
        return [r == 1 for r in await self._refresh.run(self.redis, [], args)]

    async def sweep(self) -> list[Lost]:
        """Running jobs (of any queue) whose lease expired."""
        rows = await self._sweep.run(self.redis, [self.keys.running()], [self.keys.prefix, SHARE_TTL_S])
        return [Lost(rid.decode(), queue.decode(), int(seq), int(tries), bool(has))
                for rid, queue, seq, tries, has in rows]

    def orphan(self, lost: Lost) -> Run:
        """The reaper's handle on a lost job: it owns no run, and its events follow the job's log."""
        return Run(lost.rid, lost.queue, "", lost.tries, seq=lost.next_seq, tenant=self.keys.queue_of(lost.queue)[1])

    async def lapsed(self) -> list[Lapsed]:
        """Queued jobs (of any queue) whose expiry passed."""
        args = [int(time.time() * 1000), self.keys.prefix, _LAPSED_PER_SWEEP]
        rows = await self._lapse.run(self.redis, [self.keys.deadlines()], args)
        return [Lapsed(rid.decode(), queue.decode(), int(seq), int(et), bool(c)) for rid, queue, seq, et, c in rows]

    def expiring(self, lapsed: Lapsed) -> Run:
        """The reaper's handle on a job that expired while queued (no run owns it)."""
        return Run(lapsed.rid, lapsed.queue, "", 0, seq=lapsed.next_seq, enqueue_ms=lapsed.enqueue_ms,
                   tenant=self.keys.queue_of(lapsed.queue)[1])

    async def reject(self, queue: str, entries: Sequence[bytes | str], reason: str) -> int:
        """Move entries of ``queue`` aside to the dead-letter list; how many were still queued."""
        now = int(time.time() * 1000)
        args: list[object] = [_DEAD_LETTERS_KEPT, _DEAD_LETTER_TTL_S]
        for entry in entries:
            raw = entry.encode() if isinstance(entry, str) else entry
            record = {"queue": queue, "entry": raw.decode(errors="backslashreplace"), "hex": raw.hex(),
                      "reason": reason, "at_ms": now, "worker": self.worker_id}
            args += (raw, json.dumps(record))
        moved: int = await self._reject.run(self.redis, [queue, self.keys.dead_letters()], args)
        return moved


def _due_entry(row: list[bytes], epoch: str) -> DueEntry:
    rid, queue, status = row[0].decode(errors="backslashreplace"), row[1].decode(), EntryStatus(row[2].decode())
    if status is not EntryStatus.STARTED:
        return DueEntry(rid, queue, status, epoch, row[0])
    _score, job, attempt, last, cancelled, placed = row[3:]
    return DueEntry(rid, queue, status, epoch, row[0], job, int(attempt), decode_event(last) if last else None,
                    bool(cancelled), _placed(placed, job))


_KEYED = re.compile(rb'"ak":"[0-9a-fA-F]+","et":\d+}$')  # a job record's tail with an affinity key (api.jobrecord)


def _placed(placed: bytes, job: bytes) -> Affinity | None:
    """CLAIM's affinity outcome; "?": nobody advertised for the model, so a keyed job counts "none" (told here, from
    the record CLAIM returns, rather than by one more read in the script)."""
    if placed == b"?":
        return Affinity.NONE if _KEYED.search(job, max(0, len(job) - 64)) else None
    return Affinity(placed.decode()) if placed else None
