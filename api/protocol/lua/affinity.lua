-- CLAIM's prefix affinity (api/affinity.py, worker/affinity.py): which of a tenant's read entries CLAIM takes next
-- (head), in place of simply its first. A job record's tail holds its affinity keys ("ak":"<hex>[,<hex>...]",
-- deepest first, at most MAX_KEYS (3) of them, before "et": the conversation's, then its system prompt's alone);
-- each worker advertises the keys its prefix cache has warm, per model, in the set
-- <prefix>:affkeys:<model>:<worker>, and itself in <prefix>:affholders:<model> scored by when that advertisement
-- lapses (ms): an advertiser is live until then. An advertiser whose engine is full is also in
-- <prefix>:afffull:<model> (scored the same way, written only when it fills or frees, rate-limited): its keys'
-- jobs do not wait for it. An entry's class follows its deepest key that a live advertiser able to take it holds
-- (a key only full advertisers hold counts only if no shallower key is held by one that is not full): "mine"
-- (this worker has that key warm), "wait" (another live worker that is not full has it warm and it became due
-- less than the wait ago: skipped, left queued), "elsewhere" (another has it warm, but it waited past the bound,
-- or every other advertiser with it is full), "none" (a key no live worker has warm) or "" (no key, or affinity
-- off: affinity_wait_ms < 0, no worker advertises for the model, or jobs read to outrank a full engine, which
-- start at once).
-- New conversations spread over the fleet, and with them their work: while other live advertisers are not full,
-- a call takes only its part of the model's read "none" jobs still within the wait (fresh_share: each goes, in
-- turn, to the live worker with room advertising the fewest keys, this one on a tie, and adds its keys there) and
-- skips the rest for at most the wait. So a burst of first requests (say one per system prompt) is not all taken
-- by the first worker to claim, and a job nobody holds waits for a worker holding fewer keys. A lone worker, one
-- whose others are full, and a call whose reads left due jobs unread (the queue is deeper than the room) take
-- them as ever. While others advertise, a started job's keys join this worker's advertisement at once (its
-- prefill stores them; the worker's next write of it keeps them, or drops the keys of a job it did not cache):
-- the next claims count them.
-- head takes the first entry not skipped, unless a "mine" one of at least its priority (the lead of its score
-- below its enqueue time: api.protocol.keys.queue_score) is among the entries read: priority, the tenants'
-- shares and the read limit stand; only the order within a tenant's read entries changes.
-- Costs: one ZRANGE of the advertisers, one GETRANGE (KEYS_TAIL bytes) per entry looked at (every read entry of
-- the model once a "none" job is met while others are live and not full), one SCARD per live advertiser, one
-- ZRANGEBYSCORE of the full ones (when others advertise), one SISMEMBER per live advertiser and distinct key
-- looked at (an entry's keys are looked at deepest first until one is held: at most MAX_KEYS each), and a SADD
-- and a PEXPIREAT per model when this advertiser started keyed jobs while others advertise; no GETRANGE while
-- no other worker advertises and this one holds no key. Uses claim.lua's now, P and worker_id; took() reports
-- "mine" as "holder" (the wire's Affinity.HOLDER); claim.lua calls affinity_started() for each job it starts and
-- writes m.adds.
-- A model's bulk band (bulk.lua) follows its model's advertisers (m.base): its jobs run in the same engine, so a
-- batch's lines sharing a system prompt go where it is warm; the advertisers are read once for both bands.
local affinity_wait = tonumber(affinity_wait_ms) or -1
local advertised = {}  -- a model's advertisers (advertisers()), by its name: one read for both of its bands
local function advertisers(m)  -- this worker's key set, its count and (if listed) when it lapses; the other live
  -- advertisers' sets, and the key counts of those not full
  if m.advertisers then return m.advertisers end
  local model = m.base or m.model
  if advertised[model] then m.advertisers = advertised[model]; return m.advertisers end
  local h = {mine = false, others = {}, seen = {}, count = 0, counts = {}}
  m.advertisers, advertised[model] = h, h
  if affinity_wait < 0 then return h end
  local zkey = P .. ':affholders:' .. model
  local listed = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')  -- one read while nobody's advertisement lapsed
  local live, lapsed = {}, false
  for i = 1, #listed, 2 do
    local lapse = tonumber(listed[i + 1])
    if lapse <= now then lapsed = true else live[#live + 1] = listed[i] end
    if listed[i] == worker_id and lapse > now then h.lapse = lapse end
  end
  if lapsed then redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now) end  -- dead, frozen or stopped
  local full = {}
  if #live > 1 or (#live == 1 and live[1] ~= worker_id) then  -- others advertise: which are full
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', P .. ':afffull:' .. model, now, '+inf')) do
      full[w] = true
    end
  end
  for _, w in ipairs(live) do
    local set = P .. ':affkeys:' .. model .. ':' .. w
    local n = redis.call('SCARD', set)
    if w == worker_id then
      h.mine, h.count, h.set = n > 0 and set, n, set  -- an empty set holds no key: no entry is "mine"
    else
      h.others[#h.others + 1] = {set, full[w] or false}
      if not full[w] then h.counts[#h.counts + 1] = n end
    end
  end
  return h
end
local function held(h, ak)  -- who holds key ak: 'mine', 'theirs' (another, not full), 'full' (only full ones) or
  -- 'none'; once per call and key
  local warm = h.seen[ak]
  if warm ~= nil then return warm end
  warm = 'none'
  if h.mine and redis.call('SISMEMBER', h.mine, ak) == 1 then
    warm = 'mine'
  else
    for _, o in ipairs(h.others) do  -- a full advertiser's key: taken elsewhere at once, unless another has it
      if redis.call('SISMEMBER', o[1], ak) == 1 then
        if not o[2] then warm = 'theirs'; break end
        warm = 'full'
      end
    end
  end
  h.seen[ak] = warm
  return warm
end
local function affinity(m, s, e)  -- the entry's class (see above), computed once per call
  if e.aff then return e.aff end
  local h = advertisers(m)
  if s.urgent or (not h.mine and #h.others == 0) then return '' end  -- placed as ever (took() tells if keyed)
  local tail = redis.call('GETRANGE', P .. ':{' .. e[1] .. '}:job', -KEYS_TAIL, -1)
  local et = tonumber(string.match(tail, '"et":(%d+)}$'))
  e.aff, e.lead = '', et and et - e[2] or -math.huge  -- no record (gone, poison): any job may go first
  local aks = string.match(tail, '"ak":"([%x,]+)","et":%d+}$')
  if not aks then return e.aff end
  e.aks = {}
  for ak in string.gmatch(aks, '%x+') do
    if #e.aks < MAX_KEYS then e.aks[#e.aks + 1] = ak end
  end
  local warm = 'none'
  for _, ak in ipairs(e.aks) do  -- deepest first: the first key held by one able to take it decides
    local class = held(h, ak)
    if class == 'mine' or class == 'theirs' then warm = class; break end
    if class == 'full' then warm = 'full' end
  end
  -- a job another live worker has warm waits for it, from when it became due: enqueued, or deferred to its score
  e.due = math.max(et, e[2])
  if warm == 'theirs' then
    warm = now - e.due < affinity_wait and 'wait' or 'elsewhere'
  elseif warm == 'full' then
    warm = 'elsewhere'
  end
  e.aff = warm
  return warm
end
local function fresh(e)  -- a job nobody holds that may still wait
  return e.aff == 'none' and now - e.due < affinity_wait
end
local function fresh_share(m)  -- how many of m's fresh jobs this call takes (false: no bound), computed once
  if m.fresh_share ~= nil then return m.fresh_share end
  m.fresh_share, m.fresh_taken = false, 0
  local h = advertisers(m)
  if #h.counts == 0 or m.more then return false end
  local counts, mine, share = {unpack(h.counts)}, h.count, 0
  for _, s in ipairs(m.tenants) do  -- in turn, to the fewest keys (this worker on a tie), adding the job's keys
    for i = s.pos, #s.entries do
      local e = s.entries[i]
      if not e.done and affinity(m, s, e) == 'none' and fresh(e) then
        local low = 1
        for j = 2, #counts do
          if counts[j] < counts[low] then low = j end
        end
        if mine <= counts[low] then
          mine, share = mine + #e.aks, share + 1
        else
          counts[low] = counts[low] + #e.aks
        end
      end
    end
  end
  m.fresh_share = share
  return share
end
local function affinity_started(m, e)  -- claim.lua started entry e: count a fresh one against the share, and
  -- advertise its keys at once (m.adds, written by claim.lua) if this worker advertises, and others do (they
  -- count them; a lone worker's next write is soon enough)
  local h = m.advertisers
  if e.aks and h.lapse and #h.others > 0 then
    for _, ak in ipairs(e.aks) do
      if h.seen[ak] ~= 'mine' then
        m.adds[#m.adds + 1] = ak
        h.seen[ak] = 'mine'  -- this call's later entries of the key are this worker's too
      end
    end
  end
  if m.fresh_share and fresh(e) then
    m.fresh_taken = m.fresh_taken + 1
    if m.fresh_taken >= m.fresh_share then  -- every tenant's head is looked for again, past the rest
      for _, s in ipairs(m.tenants) do s.pick = nil end
    end
  end
end
local function head(m, s)  -- the index of the entry CLAIM takes next from tenant s, or nil
  if s.pick ~= nil then return s.pick or nil end
  local first = nil
  local h = advertisers(m)
  for i = s.pos, #s.entries do
    local e = s.entries[i]
    if not e.done then
      local class = affinity(m, s, e)
      if class == 'none' and fresh(e) and fresh_share(m) and m.fresh_taken >= m.fresh_share then class = 'wait' end
      if class == 'mine' and (not first or e.lead >= s.entries[first].lead) then first = i; break end
      if class ~= 'wait' and not first then
        first = i
        if not h.mine then break end  -- advertising nothing, no later entry is preferred
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
