-- reply_complete: keep the answer of a finished call for the retries of its idempotency key.
--
-- KEYS[1] reply hash 'sc:{TAG}:reply:<digest>'
-- ARGV: token (the attempt that claimed the key), status, headers_json, body, reply_ttl_ms
-- Returns {'ok'}, or {'lost'} when this attempt no longer holds the key.
-- Why: only the attempt that claimed the key may answer for it; one whose marker expired (it
-- outlived its lease) must not overwrite the call another attempt made since. Safe to run twice:
-- a resent completion finds its own answer and is 'ok'.
local token = ARGV[1]
local ttl_ms = int(ARGV[5], 'reply_ttl_ms')
if ttl_ms < 1 then fail('BADARG', 'reply_ttl_ms') end

local r = reply_state(KEYS[1])
if r.token ~= token then
  return {'lost'}
end
if r.state == 'in_flight' then
  redis.call('HSET', KEYS[1], 'state', 'done', 'fingerprint', r.fingerprint, 'token', token,
             'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], istr(ttl_ms))
end
return {'ok'}
