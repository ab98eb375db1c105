-- The history a job's end adds (api.history, EMIT): its model's time bucket (jobs, errors, tokens, histograms of
-- TTFT and queue wait over HIST_EDGES) and its summary on the recent list; once per job, never per token. Uses
-- the including script's now_ms and prefix.
--#include queues
local function bin(ms)
  for i, edge in ipairs(HIST_EDGES) do if ms <= edge then return i - 1 end end
  return #HIST_EDGES - 1
end
local function num(v) if type(v) == 'number' then return v end return nil end
local function history(queue, rid, owner, text)
  local okd, ev = pcall(cjson.decode, text)
  if not okd or type(ev) ~= 'table' then return end
  local model, tenant = model_tenant(prefix, queue)  -- a tenant's queue names its model too
  if not model then return end
  local now = tonumber(now_ms)
  local key = prefix .. ':hist:' .. model .. ':' .. math.floor(now / (1000 * BUCKET_S))
  local t = type(ev.timings) == 'table' and ev.timings or {}
  local u = type(ev.usage) == 'table' and ev.usage or {}
  local ttft, wait, tokens = num(t.ttft_ms), num(t.queue_ms), num(u.completion_tokens) or 0
  local first = redis.call('HINCRBY', key, 'n', 1) == 1  -- a new bucket: its TTL once (it outlives its window)
  if ev.type == 'error' then redis.call('HINCRBY', key, 'err', 1) end
  if tokens > 0 then redis.call('HINCRBY', key, 'tok', tokens) end
  if ttft then redis.call('HINCRBY', key, 't' .. bin(ttft), 1) end
  if wait then redis.call('HINCRBY', key, 'w' .. bin(wait), 1) end
  if first then redis.call('EXPIRE', key, HISTORY_TTL_S) end
  local summary = cjson.encode({id = rid, model = model, tenant = tenant, type = ev.type,
    reason = ev.finish_reason or ev.code or '', ttft_ms = ttft or false, queue_ms = wait or false,
    total_ms = num(t.total_ms) or false, prompt_tokens = num(u.prompt_tokens) or false,
    completion_tokens = num(u.completion_tokens) or false, at_ms = now,
    worker = string.match(owner, '^(.*):%d+$') or ''})
  if redis.call('LPUSH', prefix .. ':recent', summary) > RECENT_KEPT then  -- one over: trimmed back
    redis.call('LTRIM', prefix .. ':recent', 0, RECENT_KEPT - 1)
  end
  redis.call('EXPIRE', prefix .. ':recent', RECENT_TTL_S)
end
