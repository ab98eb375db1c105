-- REJECT (api.protocol.upkeep): moves queue entries no worker can run aside, out of the queue onto the
-- dead-letter list (bounded to DEAD_LETTERS_KEPT, with a TTL). Returns how many entries were still queued.
local moved = 0
for _, r in ipairs(rejected) do
  if redis.call('ZREM', queue_key, r.entry) == 1 then
    moved = moved + 1
    redis.call('LPUSH', dead_key, r.record)
  end
end
redis.call('LTRIM', dead_key, 0, DEAD_LETTERS_KEPT - 1)
redis.call('EXPIRE', dead_key, DEAD_LETTER_TTL_S)
return moved
