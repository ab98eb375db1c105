-- CLAIM (api.protocol.claim): queued -> running, from several models' queues in one call. For each model queue
-- (model_queues: the default tenant's, arq's queue) whose quota is above 0, its backlogged tenants' due entries
-- (share.lua); then start, one at a time, each model's next job from its tenant with the least virtual work
-- (lowest score first within a tenant, affinity.lua choosing among its read entries), taking across models the one
-- of lowest score, up to each model's quota and most_jobs in all: takes the lease with token "<worker id>:<try>",
-- counts the try (only here: a try is a run that started), lists the job as running (value "<score> <queue>", so
-- a hand-back can queue it in its old place), counts it running for its tenant, and takes it out of its queue and
-- its deadline. A job whose lease another run still holds stays queued, due a lease TTL later, with no try
-- counted. An entry that is no job id (not what a producer makes: wrong bytes or length) comes back as poison,
-- one without a job record as gone: both for REJECT. Also reads the deployment's epoch (setting it to new_epoch
-- if Redis has none: a fresh or emptied server), each started job's last logged event, and whether a cancel is
-- pending; and whether due jobs were left queued (for lack of quota, a tenant's cap, or beyond the read limit).
-- Per queue (per_queue): its quota; what a job needs to outrank a full engine's running sequences (outranking.lua);
-- what a tenant must be for a full engine to take its job (share.lua): from such a queue only tenants below their
-- share there are read as usual (the others by priority if the queue has a priority need, or not at all).
-- A model's bulk band (bulk.lua: its own queues, read after its interactive ones) takes only what they leave.
-- Returns {epoch, left 0|1|2 (2: an interactive job among those left, not only bulk jobs), {id, queue, "started", score, job, try, last event or false, cancelled 0|1,
-- affinity "holder" | "elsewhere" | "none" | "" | "?" (nobody advertises: "none" if the job has a key), tenant} |
-- {id, queue, "deferred" | "gone" | "poison", tenant}, ...}.
-- Its cost with one tenant and no advertiser, beyond the jobs' own reads and writes: the backlog, the model's
-- share account and the tenant's policy (one read each), and per tenant queue one write each of the running
-- list, the queue, the deadlines and the three running counts (not one per started job); their hashes' TTLs
-- only where a count starts from none (a running count's TTL is set again by each of its jobs' ends). A model's
-- bulk queue adds three calls with none queued (bulk.lua says what it adds with some).
--#include queues
local P = prefix
local epoch = redis.call('GET', epoch_key)
if not epoch then epoch = new_epoch end
redis.call('SET', epoch_key, epoch, 'EX', EPOCH_TTL_S)
local now, most, limit = tonumber(now_ms), tonumber(most_jobs), tonumber(read_limit)
local left = 0
local function leave(m)  -- due jobs of model queue m left queued: 2 if they are interactive ones (bulk.lua)
  left = math.max(left, m.bulk and 1 or 2)
end
local function is_job_id(id)  -- what a producer makes; anything else in a queue is poison
  return #id <= 64 and string.match(id, '^[%w_.:%-]+$') ~= nil
end
--#include share
--#include outranking
--#include bulk
-- models[q] = {share key, floor, tenants = {{t, key, entries, pos, vt, run, mean, weight}, ...}}
local models = {}
for q, queue_key in ipairs(model_queues) do
  local row = per_queue[q]
  local quota = tonumber(row.quota)
  local model = model_tenant(P, queue_key)
  local backlog = P .. ':backlog:' .. model
  local m = {share = P .. ':share:' .. model, tenants = {}, quota = quota, model = model, adds = {}}
  models[q] = m
  quota = band_quota(m, quota); m.quota = quota
  local names, seen = {DEFAULT_TENANT}, {[DEFAULT_TENANT] = true}
  local members = redis.call('SMEMBERS', backlog)
  for _, t in ipairs(members) do
    if not seen[t] then seen[t] = true; names[#names + 1] = t end
  end
  m.backlogged = #members  -- the backlog's size as this call leaves it (EXISTS without a call)
  -- the model's floor and running count, and the default tenant's account (the one read with one tenant)
  local acct = redis.call('HMGET', m.share, '~floor', '~r', DEFAULT_TENANT, DEFAULT_TENANT .. ':r',
                          DEFAULT_TENANT .. ':a')
  m.floor, m.running, m.default = tonumber(acct[1]) or 0, acct[2] ~= false, {acct[3], acct[4], acct[5]}
  local fs = parse_below_share(row.below_share)
  local need, aging = outrank_need(row)
  local function gone(t, key)  -- no due entry read: is its queue gone? (then it leaves the backlog)
    if redis.call('EXISTS', key) == 0 then
      m.backlogged = m.backlogged - redis.call('SREM', backlog, t)
      return true
    end
    return false
  end
  for _, t in ipairs(names) do
    local key = queue_of(P, model, t)
    if quota <= 0 or capped(t) or (fs and not below(fs, t) and row.outrank == '') then
      -- no quota, capped, or at or above its share in a full engine
      if redis.call('ZCOUNT', key, '-inf', now) > 0 then leave(m) else gone(t, key) end
    else
      local entries, more = {}, false
      if need and not (fs and below(fs, t)) then
        entries, more = outranking(key, need, aging, quota)
      else
        local n = limit
        if fs and below(fs, t) then  -- a full engine takes only the jobs that keep it within its share there
          n = math.max(1, math.floor(fs.spare * policy(t)[1] - (fs.running[t] or 0) + 1e-9))
        end
        local raw = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, n)
        more = #raw >= 2 * n
        for i = 1, #raw, 2 do entries[#entries + 1] = {raw[i], tonumber(raw[i + 1])} end
      end
      if more then leave(m); m.more = true end
      if #entries > 0 then
        local acct = t == DEFAULT_TENANT and m.default or redis.call('HMGET', m.share, t, t .. ':r', t .. ':a')
        m.tenants[#m.tenants + 1] = {t = t, key = key, entries = entries, pos = 1, vt = tonumber(acct[1]) or 0,
          run = tonumber(acct[2]) or 0, mean = tonumber(acct[3]) or MEAN_WORK, weight = policy(t)[1],
          urgent = need ~= nil, ids = {}, rows = {}, members = {}}
      elseif not more then
        gone(t, key)
      end
    end
  end
end
settle(models)
--#include affinity
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
  for q, m in ipairs(models) do  -- across models: the lowest score (it orders by priority and enqueue time)
    if (taken[m.base] or 0) < m.quota then  -- a model's two bands share its quota (bulk.lua)
      local s = next_of(m)
      if s and (not pick or band_before(m, s.entries[head(m, s)][2], models[pq],
                                        pick.entries[head(models[pq], pick)][2])) then
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
    out[#out + 1] = {id, queue, 'poison', pick.t}
  else
    local base = P .. ':{' .. id .. '}:'
    local job, tries, cancel = unpack(redis.call('MGET', base .. 'job', base .. 'tries', base .. 'cancel'))
    if not job then
      out[#out + 1] = {id, queue, 'gone', pick.t}
    else
      local try = tonumber(tries or '0') + 1
      if redis.call('SET', base .. 'lease', worker_id .. ':' .. try, 'NX', 'PX', lease_ms) then
        started = started + 1
        taken[m.base] = (taken[m.base] or 0) + 1
        redis.call('SET', base .. 'tries', try, 'EX', TRIES_TTL_S)
        -- listed running, out of its queue and deadlines: written after the loop, once per tenant queue
        pick.ids[#pick.ids + 1] = id
        pick.rows[#pick.rows + 1] = id
        local listed = string.format('%d', score)
        pick.rows[#pick.rows + 1] = listed .. ' ' .. queue
        pick.members[#pick.members + 1] = id .. '@' .. queue
        pick.run = pick.run + 1  -- counted at once for this call's next picks (the caps, the shares)
        running[pick.t] = running[pick.t] + 1
        local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
        affinity_started(m, entry)
        out[#out + 1] = {id, queue, 'started', listed, job, try, last and last[2][2] or false,
                         cancel and 1 or 0, outcome, pick.t}
      else
        redis.call('ZADD', queue, now + tonumber(lease_ms), id)
        out[#out + 1] = {id, queue, 'deferred', pick.t}
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
for _, m in ipairs(models) do  -- due jobs left behind: for lack of quota, a cap, the read limit, or affinity
  for _, s in ipairs(m.tenants) do
    if s.pos <= #s.entries then leave(m) end
    if #s.ids > 0 then  -- its started jobs: running (counted once each: a job already listed is not again)
      local new = each('HSET', running_key, s.rows)
      each('ZREM', s.key, s.ids)
      each('ZREM', deadlines_key, s.members)
      if new > 0 then
        -- a count that starts here may have made its hash: it expires (once, below); a count running already
        -- leaves the TTL as is (each of its jobs' end or hand-back sets it again, as EMIT and SWEEP count out)
        if redis.call('HINCRBY', m.share, s.t .. ':r', new) == new then m.counted = true end
        if redis.call('HINCRBY', m.share, '~r', new) == new then m.counted = true end
        if redis.call('HINCRBY', P .. ':tenants:running', s.t, new) == new then counted = true end
      end
    end
  end
  if m.counted then redis.call('EXPIRE', m.share, SHARE_TTL_S) end
  if #m.adds > 0 then  -- the started jobs' keys, advertised at once (affinity.lua): they lapse with the advertiser
    each('SADD', m.advertisers.set, m.adds)
    redis.call('PEXPIREAT', m.advertisers.set, m.advertisers.lapse)
  end
end
if counted then redis.call('EXPIRE', P .. ':tenants:running', SHARE_TTL_S) end
out[2] = left
return out
