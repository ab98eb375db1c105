-- BATCH_STATUS (api.batches): move a batch to status 'to' (stamping '<to>_at' with now_s) only from one of the
-- space-separated statuses 'from'; 'fields' is a JSON object of more fields to set with it. A terminal status
-- also takes the batch off the open set (feeders stop looking at it). Returns 1 (moved) or 0 (its status was
-- another: someone else moved it first).
local status = redis.call('HGET', batch_key, 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(from, '%S+') do
  if s == status then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', batch_key, 'status', to, to .. '_at', now_s)
for k, v in pairs(cjson.decode(fields)) do redis.call('HSET', batch_key, k, v) end
if terminal == '1' then redis.call('SREM', open_key, batch_id) end
return 1
