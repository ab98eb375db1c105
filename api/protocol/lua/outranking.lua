-- CLAIM's outranking (Outranking, api.protocol.claim): what a full engine takes is a job that outranks its
-- running sequences. From a queue whose row says so (`outrank`: "<priority> <aging ms>") only the first jobs (up
-- to its quota) of at least that priority are read, each one's priority recovered from its score and its
-- record's enqueue time (records end with "et":<ms>}: api.protocol.jobrecord.job_record; GETRANGE reads only that
-- tail), among the first OUTRANK_READ entries that could have them (api.protocol.keys.queue_score: never above
-- enqueue time). Uses claim.lua's now, P and is_job_id.
local function outrank_need(row)  -- the priority and aging (ms) a queue's jobs need, or nil
  local need, aging = string.match(row.outrank, '^(%-?%d+) (%d+)$')
  if not need then return nil, nil end
  return tonumber(need), tonumber(aging)
end
local function outranking(key, need, aging, n)
  -- the first n queued jobs of priority >= need; score = enqueue - (priority - PRIORITY_MIN) * aging
  local lead = (need - PRIORITY_MIN) * aging  -- how far below its enqueue time such a job's score is, at least
  local entries = redis.call('ZRANGEBYSCORE', key, '-inf', now - lead, 'WITHSCORES', 'LIMIT', 0, OUTRANK_READ)
  local found = {}
  for i = 1, #entries, 2 do
    if #found >= n then break end
    local id, score = entries[i], tonumber(entries[i + 1])
    if is_job_id(id) then
      local tail = redis.call('GETRANGE', P .. ':{' .. id .. '}:job', -32, -1)
      local et = tonumber(string.match(tail, '"et":(%d+)}$'))
      if et and et - score >= lead then found[#found + 1] = {id, score} end
    end
  end
  return found, redis.call('ZCOUNT', key, '-inf', now) > #found
end
