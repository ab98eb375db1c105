-- A job's end as a webhook event (api.protocol.notify, EMIT): when the job's notify key names what its end
-- means (`<family> <object id> <tenant>`, e.g. `response resp_<id> default`), its end becomes one entry of the
-- webhook stream, `<family>.<status>`, and the key goes: once per job, in the call that writes its end. Uses the
-- including script's now_ms and prefix. status: completed, incomplete (done length), cancelled, failed (error).
local function notify(base, final)
  local note = redis.call('GET', base .. 'notify')
  if not note then return end
  redis.call('DEL', base .. 'notify')
  local family, object, tenant = string.match(note, '^(%S+) (%S+) (%S+)$')
  if not family then return end
  local status = 'failed'
  if string.match(final, '"type":"(%a+)"') == 'done' then  -- the event's own type is its first "type"
    local reason = string.match(final, '"finish_reason":"([%w_]+)"')
    status = (reason == 'length' and 'incomplete') or (reason == 'cancelled' and 'cancelled') or 'completed'
  end
  redis.call('XADD', prefix .. ':webhooks', 'MAXLEN', '~', WEBHOOKS_KEPT, '*', 'type', family .. '.' .. status,
             'id', object, 'tenant', tenant, 'at_ms', now_ms)
end
