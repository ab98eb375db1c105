-- ENQUEUE (api.protocol.producer): one round trip. Refuse a reused id or a full queue, store the job record,
-- queue it on its tenant's queue (and its expiry), mark the tenant backlogged for the model, and wake the
-- model's workers (wake_channel "" for none: a burst sent together wakes them once, from its last job, even if
-- that job is refused). max_queued: most jobs queued for the model, all tenants (0: no cap); expiry_ms 0: none.
-- Returns 1 (queued), 0 (the id is taken), -1 (the model's queue is full) or -2 (the tenant's max_queued is
-- reached). The same record stored already is this submit's own earlier try (its reply was lost): success
-- again. The queue, the backlog set and the deadlines live as long as a job record after the last enqueue. A
-- tenant new to the backlog gets no credit for its idle time (claim.lua: its virtual work is lifted to the
-- floor). The model's cap sums the backlogged tenants' queues (a producer's cost, not a claim's).
--#include queues
if wake_channel ~= '' then redis.call('PUBLISH', wake_channel, '1') end
local stored = redis.call('GET', job_key)
if stored then return stored == job and 1 or 0 end
if redis.call('EXISTS', result_key) > 0 then return 0 end
local own = redis.call('ZCARD', queue_key)
local cap = tonumber(redis.call('HGET', policy_key, 'max_queued') or '0')
if cap and cap > 0 and own >= cap then return -2 end
if max_queued ~= '0' then
  local total, seen = own, {[tenant] = true}
  for _, t in ipairs(redis.call('SMEMBERS', backlog_key)) do
    if not seen[t] then
      seen[t] = true
      total = total + redis.call('ZCARD', queue_of(prefix, model, t))
    end
  end
  if not seen[DEFAULT_TENANT] then
    total = total + redis.call('ZCARD', queue_of(prefix, model, DEFAULT_TENANT))
  end
  if total >= tonumber(max_queued) then return -1 end
end
redis.call('PSETEX', job_key, ttl_ms, job)
redis.call('ZADD', queue_key, score, rid)
redis.call('PEXPIRE', queue_key, ttl_ms)
if redis.call('SADD', backlog_key, tenant) == 1 then  -- back from idle: its fair share starts at the floor
  local share = prefix .. ':share:' .. model
  local acct = redis.call('HMGET', share, tenant, '~floor')
  if tonumber(acct[2] or '0') > tonumber(acct[1] or '0') then redis.call('HSET', share, tenant, acct[2]) end
end
redis.call('PEXPIRE', backlog_key, ttl_ms)
if expiry_ms ~= '0' then
  redis.call('ZADD', deadlines_key, expiry_ms, deadline_member)
  redis.call('PEXPIRE', deadlines_key, ttl_ms)
end
return 1
