-- reply_abandon: give an idempotency key back after a call that leaves no answer to replay.
--
-- KEYS[1] reply hash 'sc:{TAG}:reply:<digest>'
-- ARGV: token (the attempt that claimed the key)
-- Returns {'ok'}.
-- Why: a call refused, failed or of unknown outcome is not kept, so that a retry makes the call
-- again (and reserves for it again) instead of waiting for a marker until it expires. Only the
-- claiming attempt's in-flight marker is removed; a finished answer never is. Safe to run twice.
local r = reply_state(KEYS[1])
if r.state == 'in_flight' and r.token == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return {'ok'}
