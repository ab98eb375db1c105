-- CLAIM's bulk band (GenerateRequest.bulk: batch jobs, which run only on idle capacity). A model's bulk jobs queue
-- under its name with BULK_MARK appended (api.protocol.keys.band_model): their own tenants' queues, backlog and
-- fair-share account, so share.lua's rules (virtual work, weights, caps) hold between tenants within the band as
-- they do for interactive jobs, and no bulk work is charged against a tenant's interactive share. A worker passes
-- a model's bulk queue after its interactive one (api.protocol.claim) with the same quota (none when its engine
-- is full: a bulk job never outranks nor takes a share's place). The two count against one quota, and a bulk
-- job is picked only when no interactive job of any model is left to pick; a bulk queue is not read at all
-- (quota 0: its due jobs are only counted, for `left`) while its model's interactive queues hold due jobs beyond
-- those this call read. Its cost per claim and model: the bulk backlog (SMEMBERS) and share account (HMGET), then
-- per backlogged bulk tenant one ZRANGEBYSCORE (one ZCOUNT while held back), an EXISTS where none is due: with
-- no bulk job queued, three calls; with some read, affinity.lua's reads as for the model's interactive jobs (its
-- advertisers are the model's: bulk jobs follow prefix affinity too, with no read of its own when the model's
-- interactive queue read them already).
-- Uses queues.lua's band_of.
local band_seen = {}  -- each interactive model read so far in this call: its entry in models
local function band_quota(m, quota)  -- a queue's quota, once its model's interactive queues have been read
  local base, bulk = band_of(m.model)
  m.base, m.bulk = base, bulk
  if not bulk then
    band_seen[base] = m
    return quota
  end
  local partner = band_seen[base]
  if partner and partner.more then return 0 end  -- interactive jobs wait unread: no bulk job starts
  return quota
end
local function band_before(m, score, other, other_score)  -- interactive before bulk, then the lower score
  if m.bulk ~= other.bulk then return other.bulk end
  return score < other_score
end
