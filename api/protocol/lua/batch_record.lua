-- BATCH_RECORD (api.batches): record one line's outcome once. The first call for a line stores its entry
-- (kind 'o' output or 'e' error, then the output line), takes the line off the in-flight set and counts it
-- (and its tokens) in the batch record; a later call for the same line (a re-fed line, a second feeder) changes
-- nothing. Returns 1 (recorded) or 0 (recorded before).
if redis.call('HSETNX', results_key, line, kind .. entry) == 0 then
  redis.call('SREM', inflight_key, line)
  return 0
end
redis.call('SREM', inflight_key, line)
redis.call('HINCRBY', batch_key, kind == 'o' and 'completed' or 'failed', 1)
if input_tokens ~= '0' then redis.call('HINCRBY', batch_key, 'input_tokens', input_tokens) end
if output_tokens ~= '0' then redis.call('HINCRBY', batch_key, 'output_tokens', output_tokens) end
return 1
