-- EMIT (api.protocol.emit): running -> running | ended | queued, and queued -> ended (expired), for several jobs in
-- one call (one round trip per engine step). `records`: `count` records, each "<size>\n<record>"; the token
-- appends (`appends`: a run's one-event appends while its log's TTL is fresh, N per engine step) skip the records'
-- parsing, the EXPIRE and a GET each, and are written as an "a" record is. A record is a line
-- "<queue bytes> <rid bytes> <owner bytes> <write> <first seq> <result bytes> <keep ms>", then queue, rid, owner
-- and result back to back, a newline, and its events (JSON texts, which never hold a raw newline) joined by
-- newlines; event i is logged as entry "<first seq + i>-1" and published on the job's channel.
-- The caller may write if (by write): a/e/h: owner is a run's token and the lease holds it, or owner is ""
-- (the reaper) and nobody holds the lease, the job is listed as running, and its log's next seq is the
-- record's first (two reapers cannot both act on one job); l: owner is the epoch the run started in and the
-- epoch moved on (Redis lost its data since) and the job record is gone; x: owner is "" and the job is still
-- queued (taking it out of its queue decides) and its log's next seq is the record's first.
-- Writes: a: append. e: end: drop lease, running entry, cancel key, job record, tries and queue entry, keep
-- the result (if any) for its keep ms and the log for the done TTL, make the end a webhook event if the job's
-- notify key asks (notify.lua); its tenant's running count drops, and a done event's usage (prompt + generated
-- tokens) is charged to its tenant's fair-share account (÷ its weight), mean work per job and tokens of this
-- minute. h: hand back: drop lease and running entry (and the running
-- count), queue the job again in its old place (the score CLAIM listed it with), due at once, its tenant
-- backlogged again. l: append, log kept for the done TTL. x: as e, and the job's deadline is dropped. e and x
-- also add the ended job to its model's history and the recent list (history.lua).
-- Returns 1 (written) or 0 (refused) per record, then per token append. An entry id already logged (a duplicate)
-- is not published.
--#include share_left
--#include history
--#include notify
local out = {}
local blob, pos = records, 1
for j = 1, tonumber(count) do
  local nl = string.find(blob, '\n', pos, true)
  local size = tonumber(string.sub(blob, pos, nl - 1))
  local rec = string.sub(blob, nl + 1, nl + size)
  pos = nl + size + 1
  local h = string.find(rec, '\n', 1, true)
  local lq, lr, lo, write, seq, lres, keep_ms = string.match(string.sub(rec, 1, h - 1),
    '^(%d+) (%d+) (%d+) (%a) (%d+) (%d+) (%d+)$')
  lq, lr, lo, seq, lres = tonumber(lq), tonumber(lr), tonumber(lo), tonumber(seq), tonumber(lres)
  local queue = string.sub(rec, h + 1, h + lq)
  local rid = string.sub(rec, h + lq + 1, h + lq + lr)
  local owner = string.sub(rec, h + lq + lr + 1, h + lq + lr + lo)
  local result = string.sub(rec, h + lq + lr + lo + 1, h + lq + lr + lo + lres)
  local base = prefix .. ':{' .. rid .. '}:'
  local lease, log = base .. 'lease', base .. 'log'
  local ok
  if write == 'l' then
    ok = redis.call('GET', epoch_key) ~= owner and redis.call('EXISTS', base .. 'job') == 0
  elseif write == 'x' then
    local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
    local next_seq = last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0
    ok = owner == '' and next_seq == seq and redis.call('ZREM', queue, rid) == 1
  elseif owner ~= '' then
    ok = redis.call('GET', lease) == owner
  else
    local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
    local next_seq = last and tonumber(string.match(last[1], '^(%d+)')) + 1 or 0
    ok = redis.call('EXISTS', lease) == 0 and redis.call('HEXISTS', running_key, rid) == 1 and next_seq == seq
  end
  if ok then
    local channel = base .. 'events'
    local final
    for event in string.gmatch(string.sub(rec, h + lq + lr + lo + lres + 2), '[^\n]+') do
      final = event
      local r = redis.pcall('XADD', log, seq .. '-1', 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', channel, event)
      end
      seq = seq + 1
    end
    if (write == 'e' or write == 'x') and final then history(queue, rid, owner, final) end
    if write == 'a' or write == 'h' then
      redis.call('EXPIRE', log, live_ttl_s)
    else
      redis.call('EXPIRE', log, done_ttl_s)
    end
    local requeue_at = now_ms
    if write == 'h' then
      local entry = redis.call('HGET', running_key, rid)
      requeue_at = entry and string.match(entry, '^(%-?%d+) ') or now_ms
    end
    if (write == 'e' or write == 'h') and redis.call('HDEL', running_key, rid) == 1 then
      local pt, ct = string.match(final or '', '"usage":{"prompt_tokens":(%d+),"completion_tokens":(%d+)[,}]')
      local charge = write == 'e' and pt ~= nil
      local model, tenant, share = share_left(prefix, queue, SHARE_TTL_S, charge)
      if model and charge then  -- charge its work: fair share, mean work, tokens per minute
        local work = tonumber(pt) + tonumber(ct)
        local weight = tonumber(redis.call('HGET', prefix .. ':tenant:' .. tenant, 'weight') or '1') or 1
        if weight <= 0 then weight = 1 end
        local acct = redis.call('HMGET', share, tenant, tenant .. ':a')  -- one read, one write (the script is atomic)
        local mean = tonumber(acct[2] or '')
        redis.call('HSET', share, tenant, string.format('%.17g', (tonumber(acct[1] or '') or 0) + work / weight),
                   tenant .. ':a', string.format('%.17g', mean and 0.8 * mean + 0.2 * work or work))
        redis.call('EXPIRE', share, SHARE_TTL_S)
        local bucket = prefix .. ':tpm:' .. tenant .. ':' .. math.floor(tonumber(now_ms) / 60000)
        if redis.call('INCRBY', bucket, work) == work then  -- new this minute: its TTL once (it outlives its read)
          redis.call('EXPIRE', bucket, 120)
        end
      end
      if model and write == 'h' then
        redis.call('SADD', prefix .. ':backlog:' .. model, tenant)
        redis.call('EXPIRE', prefix .. ':backlog:' .. model, JOB_TTL_MS)
      end
    end
    if write == 'e' or write == 'h' then
      redis.call('DEL', lease)
    end
    if write == 'e' or write == 'x' then
      redis.call('DEL', base .. 'cancel', base .. 'job', base .. 'tries')
      redis.call('ZREM', queue, rid)
      if lres > 0 and keep_ms ~= '0' then redis.call('SET', base .. 'result', result, 'PX', keep_ms) end
      if final then notify(base, final) end
    end
    if write == 'x' then
      redis.call('ZREM', deadlines_key, rid .. '@' .. queue)
    elseif write == 'h' then
      redis.call('ZADD', queue, requeue_at, rid)
    end
    out[j] = 1
  else
    out[j] = 0
  end
end
-- The token appends: a lease check, the log entry and its publish; nothing to parse, the log's TTL left as is.
local n = #out
for from = 1, #appends, APPENDS_PER_READ do  -- the leases read APPENDS_PER_READ at a time: one MGET each
  local last = math.min(#appends, from + APPENDS_PER_READ - 1)
  local bases, leases = {}, {}
  for i = from, last do
    local base = prefix .. ':{' .. appends[i].rid .. '}:'
    bases[#bases + 1] = base
    leases[#leases + 1] = base .. 'lease'
  end
  local held = redis.call('MGET', unpack(leases))
  for k, base in ipairs(bases) do
    local a = appends[from + k - 1]
    n = n + 1
    if held[k] == a.owner then
      local event = a.event
      local r = redis.pcall('XADD', base .. 'log', a.entry, 'e', event)
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', base .. 'events', event)
      end
      out[n] = 1
    else
      out[n] = 0
    end
  end
end
return out
