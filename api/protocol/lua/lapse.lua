-- LAPSE (api.protocol.upkeep): the expiry sweep's read, queued jobs whose deadline passed (at most LAPSED_PER_SWEEP).
-- Members whose job is no longer queued (started, ended, or gone) are dropped here.
-- Returns {rid, queue, next seq, enqueue ms (0 if the record is gone), cancel requested 0|1, ...}.
local out = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now_ms, 'LIMIT', 0, LAPSED_PER_SWEEP)) do
  local at = string.find(member, '@', 1, true)
  local rid = at and string.sub(member, 1, at - 1)
  local queue = at and string.sub(member, at + 1)
  if at and redis.call('ZSCORE', queue, rid) then
    local base = prefix .. ':{' .. rid .. '}:'
    local job = redis.call('GET', base .. 'job')
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    out[#out + 1] = {rid, queue, last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0,
                     job and string.match(job, '"et":(%d+)}$') or '0', redis.call('EXISTS', base .. 'cancel')}
  else
    redis.call('ZREM', deadlines_key, member)
  end
end
return out
