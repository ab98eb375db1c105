-- A running job left (ended or handed back): count it out of its tenant's and model's running counts
-- (EMIT, SWEEP). later: the caller writes the share hash again and sets its TTL then.
--#include queues
local function share_left(P, queue, ttl, later)
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
