-- SWEEP (api.protocol.upkeep): the reaper's read, every running job whose lease is gone. One whose log already
-- ends with its terminal event only lost its bookkeeping: its running entry (and its tenant's running count) is
-- dropped here. Returns {rid, queue, next seq, tries, 1 if its job record exists else 0, ...} for the others.
--#include share_left
local out = {}
local running = redis.call('HGETALL', running_key)
for i = 1, #running, 2 do
  local rid = running[i]
  local base = prefix .. ':{' .. rid .. '}:'
  if redis.call('EXISTS', base .. 'lease') == 0 then
    local last = redis.call('XREVRANGE', base .. 'log', '+', '-', 'COUNT', 1)[1]
    local kind = last and cjson.decode(last[2][2])['type']
    local queue = string.match(running[i + 1], '^%-?%d+ (.*)$') or running[i + 1]
    if kind == 'done' or kind == 'error' then
      redis.call('HDEL', running_key, rid)
      share_left(prefix, queue, SHARE_TTL_S)
    else
      out[#out + 1] = {rid, queue, last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0,
                       tonumber(redis.call('GET', base .. 'tries') or '0'), redis.call('EXISTS', base .. 'job')}
    end
  end
end
return out
