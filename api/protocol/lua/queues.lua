-- The queue-name format, from the parts every prologue declares (api.protocol.keys.QUEUE_NAMES), as
-- api.protocol.keys.Keys builds (queue) and parses (queue_of) names in Python.
local function queue_of(P, M, T)  -- the queue of model M's jobs of tenant T under prefix P
  if T == DEFAULT_TENANT then return P .. ':' .. QUEUE_PART .. ':' .. M end
  return P .. ':' .. TENANT_QUEUE_PART .. ':' .. T .. ':' .. M
end
local function model_tenant(P, queue)  -- the model and tenant of a queue name (nil, nil: none of ours)
  local tq = P .. ':' .. TENANT_QUEUE_PART .. ':'
  if string.sub(queue, 1, #tq) == tq then
    local rest = string.sub(queue, #tq + 1)
    local colon = string.find(rest, ':', 1, true)
    if colon then return string.sub(rest, colon + 1), string.sub(rest, 1, colon - 1) end
    return nil, nil
  end
  local q = P .. ':' .. QUEUE_PART .. ':'
  if string.sub(queue, 1, #q) == q then return string.sub(queue, #q + 1), DEFAULT_TENANT end
  return nil, nil
end
local function band_of(M)  -- the model of a queue's model name, and whether it is its bulk band (keys.model_band)
  if #M > #BULK_MARK and string.sub(M, -#BULK_MARK) == BULK_MARK then return string.sub(M, 1, -#BULK_MARK - 1), true end
  return M, false
end
