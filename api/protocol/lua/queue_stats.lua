-- QUEUE_STATS (api.registry): a queue's depth and the enqueue time of its oldest waiting job. Entries are read in
-- score order, each job's enqueue time from the tail of its record (records end with "et":<ms>}; GETRANGE reads
-- only that, though a record may hold a megabyte of prompt). A score never exceeds its job's enqueue time
-- (api.protocol.keys.queue_score moves higher priorities earlier, never later), so once a score reaches the
-- oldest time found no later entry can be older: the scan reads only the jobs priority put ahead of the oldest
-- one (at most the queue's depth). The exception, an entry a worker deferred (its lease was still held) to a due
-- time ahead of now, is read too.
local depth = redis.call('ZCARD', queue_key)
local oldest = false
local chunk = tonumber(chunk_size)
local function read(id)
  local tail = redis.call('GETRANGE', prefix .. ':{' .. id .. '}:job', -32, -1)
  local et = tonumber(string.match(tail, '"et":(%d+)}$'))
  if et and (not oldest or et < oldest) then oldest = et end
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', queue_key, '(' .. now_ms, '+inf', 'LIMIT', 0, chunk)) do
  read(id)
end
for from = 0, depth - 1, chunk do
  local entries = redis.call('ZRANGE', queue_key, from, from + chunk - 1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    if oldest and tonumber(entries[i + 1]) >= oldest then return {depth, oldest} end
    read(entries[i])
  end
end
return {depth, oldest}
