-- CANCEL (api.protocol.producer): cancel a job that exists. Returns 1 (requested), 2 (it ended already: its log
-- or its kept result is there; nothing to cancel) or 0 (no such job).
if redis.call('EXISTS', job_key) == 1 then
  redis.call('SET', cancel_key, '1', 'EX', CANCEL_TTL_S)
  redis.call('PUBLISH', cancel_channel, rid)
  return 1
end
if redis.call('EXISTS', log_key) == 1 or redis.call('EXISTS', result_key) == 1 then return 2 end
return 0
