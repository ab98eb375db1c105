-- CLAIM's prefix affinity (api/affinity.py, worker/affinity.py): which of a tenant's read entries CLAIM takes next
-- (head), in place of simply its first. A job record's tail holds its affinity keys ("ak":"<hex>[,<hex>...]",
-- deepest first, at most MAX_KEYS (3) of them, before "et": the conversation's, then its system prompt's alone);
-- each worker advertises the keys its prefix cache has warm, per model, in the set
-- <prefix>:affkeys:<model>:<worker>, and itself in <prefix>:affholders:<model> scored by when that advertisement
-- lapses (ms): an advertiser is live until then. An advertiser whose engine is full is also in
-- <prefix>:afffull:<model> (scored the same way, written only when it fills or frees, rate-limited): its keys'
-- jobs do not wait for it. An entry's class follows its deepest key that a live advertiser able to take it holds
-- (a key only full advertisers hold counts only if no shallower key is held by one that is not full): "mine"
-- (this worker has that key warm), "wait" (another live worker that is
-- not full has it warm and it became due less than the wait ago: skipped, left queued), "elsewhere" (another has
-- it warm, but it waited past the bound, or every other advertiser with it is full), "none" (a key no live worker
-- has warm) or "" (no key, or affinity off: affinity_wait_ms < 0, no worker advertises for the model, or jobs read
-- to outrank a full engine, which start at once). A "none" job also waits (at most as long) while another live
-- advertiser that is not full advertises fewer keys than this worker: the keys spread over the fleet, and with
-- them the conversations' work. head takes the first entry not skipped, unless a "mine" one of at least its
-- priority (the lead of its score below its enqueue time: api.protocol.keys.queue_score) is among the entries
-- read: priority, the tenants' shares and the read limit stand; only the order within a tenant's read entries
-- changes. Costs: one ZRANGE of the advertisers, one GETRANGE (KEYS_TAIL bytes) per entry looked at, one SCARD per live
-- advertiser, one ZRANGEBYSCORE of the full ones (when others advertise), one SISMEMBER per live advertiser and
-- distinct key looked at (an entry's keys are looked at deepest first until one is held: at most MAX_KEYS each);
-- no GETRANGE while no live worker advertises a key for the model (an advertiser of no key has no job's key).
-- A model's bulk band (bulk.lua) follows its model's advertisers (m.base): its jobs run in the same engine, so a
-- batch's lines sharing a system prompt go where it is warm; the advertisers are read once for both bands.
-- Uses claim.lua's now, P and worker_id; took() reports "mine" as "holder" (the wire's Affinity.HOLDER).
local affinity_wait = tonumber(affinity_wait_ms) or -1
local advertised = {}  -- a model's advertisers (advertisers()), by its name: one read for both of its bands
local function advertisers(m)  -- this worker's key set (if it advertises), the other live advertisers' sets,
  -- and whether one of them advertises fewer keys than this worker (then it is the one to take a job nobody has)
  local model = m.base or m.model
  if advertised[model] then return advertised[model] end
  local h = {mine = false, others = {}, seen = {}, fewer = false}
  advertised[model] = h
  if affinity_wait < 0 then return h end
  local zkey = P .. ':affholders:' .. model
  local listed = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')  -- one read while nobody's advertisement lapsed
  local live, lapsed = {}, false
  for i = 1, #listed, 2 do
    if tonumber(listed[i + 1]) <= now then lapsed = true else live[#live + 1] = listed[i] end
  end
  if lapsed then redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now) end  -- dead, frozen or stopped
  local full = {}
  if #live > 1 or (#live == 1 and live[1] ~= worker_id) then  -- others advertise: which are full
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', P .. ':afffull:' .. model, now, '+inf')) do
      full[w] = true
    end
  end
  local mine_n, fewest = 0, nil
  for _, w in ipairs(live) do
    local set = P .. ':affkeys:' .. model .. ':' .. w
    local n = redis.call('SCARD', set)
    if w == worker_id then
      h.mine, mine_n = n > 0 and set, n  -- an empty set holds no key: no entry is "mine"
    else
      h.others[#h.others + 1] = {set, full[w] or false}
      if not full[w] and (not fewest or n < fewest) then fewest = n end
    end
  end
  h.fewer = h.mine and fewest ~= nil and fewest < mine_n
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
  local warm, n = 'none', 0
  for ak in string.gmatch(aks, '%x+') do  -- deepest first: the first key held by one able to take it decides
    n = n + 1
    if n > MAX_KEYS then break end
    local class = held(h, ak)
    if class == 'mine' or class == 'theirs' then warm = class; break end
    if class == 'full' then warm = 'full' end
  end
  -- a job another live worker has warm waits for it, one nobody has for the live advertiser of the fewest keys
  -- (so conversations spread over the fleet), from when it became due: enqueued, or deferred to its score
  if warm == 'theirs' or (warm == 'none' and h.fewer) then
    local waiting = now - math.max(et, e[2]) < affinity_wait
    warm = waiting and 'wait' or (warm == 'theirs' and 'elsewhere' or 'none')
  elseif warm == 'full' then
    warm = 'elsewhere'
  end
  e.aff = warm
  return warm
end
local function head(m, s)  -- the index of the entry CLAIM takes next from tenant s, or nil
  if s.pick ~= nil then return s.pick or nil end
  local first = nil
  local h = advertisers(m)
  for i = s.pos, #s.entries do
    local e = s.entries[i]
    if not e.done then
      local class = affinity(m, s, e)
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
