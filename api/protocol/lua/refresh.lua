-- REFRESH (api.protocol.upkeep): extends the leases still held by their run. Returns 1 (extended) or 0 (lost)
-- per lease.
local out = {}
for _, l in ipairs(leases) do
  local lease = prefix .. ':{' .. l.rid .. '}:lease'
  if redis.call('GET', lease) == l.token then
    out[#out + 1] = redis.call('PEXPIRE', lease, lease_ms)
  else
    out[#out + 1] = 0
  end
end
return out
