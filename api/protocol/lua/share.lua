-- CLAIM's fair share across tenants (api/tenants.py, engine/core/shares.py). A model's jobs wait on one queue per
-- tenant (api.protocol.keys.Keys.queue), and <prefix>:backlog:<model> lists the tenants that may have some queued.
-- Start-time fair queuing over work (as VTC): each (model, tenant) has a virtual work account in
-- <prefix>:share:<model>: tokens (prompt + generated) of its ended jobs ÷ its weight, charged when a job ends
-- (emit.lua). A claim serves the backlogged tenant with the least virtual work, counting its running jobs at its
-- mean work per job (MEAN_WORK before its first job ends, so a burst of starts spreads by weight before any of
-- them ends); a tenant back from idle (enqueue.lua adds it to the backlog again) is lifted to ~floor, the least
-- virtual work among the backlogged at the last claim: no credit for idle time. A tenant at its max_running
-- (fleet-wide, <prefix>:tenants:running) or its tokens_per_minute (<prefix>:tpm:<tenant>:<minute>) is passed
-- over: its jobs wait. The cost grows with the backlogged tenants, never with the queued jobs.
-- A full engine takes a job of a tenant below its share there (BelowShare, api.protocol.claim): a queue's row
-- `below_share` is "<spare> <tenant> <running> ..." or "". Uses claim.lua's now and P.
local function parse_below_share(arg)  -- {spare, running = {tenant = n}}, or nil
  local spare, rest = string.match(arg or '', '^(%S+)(.*)$')
  if not spare then return nil end
  local s = {spare = tonumber(spare), running = {}}
  for t, n in string.gmatch(rest, '(%S+) (%d+)') do s.running[t] = tonumber(n) end
  return s
end
local running = {}  -- each tenant's jobs running fleet-wide, as counted, plus this call's starts
local policies = {}
local minute = math.floor(now / 60000)
local function policy(t)  -- {weight, max running, tokens per minute}
  local p = policies[t]
  if not p then
    local v = redis.call('HMGET', P .. ':tenant:' .. t, 'weight', 'max_running', 'tokens_per_minute')
    p = {tonumber(v[1]) or 1, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
    if p[1] <= 0 then p[1] = 1 end
    running[t] = 0  -- read only where a cap needs it
    if p[2] > 0 then running[t] = tonumber(redis.call('HGET', P .. ':tenants:running', t) or '0') end
    if p[3] > 0 then  -- the last minute's tokens: this minute's, and the previous minute's part still inside
      local cur = tonumber(redis.call('GET', P .. ':tpm:' .. t .. ':' .. minute) or '0')
      local prev = tonumber(redis.call('GET', P .. ':tpm:' .. t .. ':' .. (minute - 1)) or '0')
      p[4] = cur + prev * (1 - (now % 60000) / 60000) >= p[3]
    end
    policies[t] = p
  end
  return p
end
local function capped(t)
  local p = policy(t)
  return (p[2] > 0 and running[t] >= p[2]) or p[4] == true
end
local function below(s, t)  -- t's load in that engine once its job runs there is at most the spare load
  return ((s.running[t] or 0) + 1) / policy(t)[1] <= s.spare
end
local function settle(models)  -- after the reads: a model with none queued and none running forgets its accounts
  -- (nobody is owed anything, and nothing is left behind in Redis); then each model's floor, the least virtual
  -- work among the backlogged: where a tenant back from idle starts
  for q = 1, #models do
    if models[q].backlogged <= 0 and not models[q].running then
      redis.call('DEL', models[q].share)
    end
  end
  for q = 1, #models do
    local m, low = models[q], nil
    for _, s in ipairs(m.tenants) do
      if not low or s.vt < low then low = s.vt end
    end
    if low and low > m.floor then
      redis.call('HSET', m.share, '~floor', string.format('%.17g', low))
      redis.call('EXPIRE', m.share, SHARE_TTL_S)
    end
  end
end
local function fair(s)  -- a tenant's virtual work, its running jobs counted at its mean work per job
  return s.vt + s.run * s.mean / s.weight
end
