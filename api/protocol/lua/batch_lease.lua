-- BATCH_LEASE (api.batches): take or keep the lease on driving a batch: free, or held by this feeder already,
-- it becomes this feeder's for ttl_ms more. Returns 1 (held now) or 0 (another feeder holds it).
local holder = redis.call('GET', lease_key)
if holder and holder ~= feeder then return 0 end
redis.call('PSETEX', lease_key, ttl_ms, feeder)
return 1
