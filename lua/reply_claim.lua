-- reply_claim: claim an idempotency key for one gateway call, or learn what became of it.
--
-- KEYS[1] reply hash 'sc:{TAG}:reply:<digest>' (digest of the API key id and Idempotency-Key)
-- KEYS[2] the API key's quota hash 'sc:{TAG}:q:<owner>' (lib: quota_read)
-- ARGV: fingerprint (digest of the request), token (this attempt's), in_flight_ttl_ms
-- Returns one of:
--   {'claimed'}                          this attempt owns the key and makes the call
--   {'in_flight'}                        another attempt is making the call
--   {'done', status, headers_json, body} the call finished; its answer, to replay
--   {'conflict'}                         the key was used with another request
--   {'state_quota', 'replies', retry_after_s}  the API key claimed all the idempotency keys its
--                                        quota allows in this window (REPLIES_PER_KEY_MAX)
-- Why: check and claim must be one step, or two instances that receive the same retry both
-- find the key free and both call the provider. The marker lives as long as a lease, so a
-- claim whose instance died is given back when its reservation would have expired. Each new
-- claim is counted in the key's quota here, where it is made. Safe to run twice: a resent
-- claim finds its own token and is 'claimed' again.
local fp, token = ARGV[1], ARGV[2]
local ttl_ms = int(ARGV[3], 'in_flight_ttl_ms')
if ttl_ms < 1 then fail('BADARG', 'in_flight_ttl_ms') end

local r = reply_state(KEYS[1])
if not r.state then
  local now = ledger_now(nil)
  local used = quota_read(KEYS[2], now)
  if used.replies >= REPLIES_PER_KEY_MAX then
    return quota_refusal('replies', used, now)
  end
  redis.call('HSET', KEYS[1], 'state', 'in_flight', 'fingerprint', fp, 'token', token)
  redis.call('PEXPIRE', KEYS[1], istr(ttl_ms))
  used.replies = used.replies + 1
  quota_write(KEYS[2], used)
  return {'claimed'}
end
if r.fingerprint ~= fp then
  return {'conflict'}
end
if r.state == 'in_flight' then
  if r.token == token then
    return {'claimed'}
  end
  return {'in_flight'}
end
local d = redis.call('HMGET', KEYS[1], 'status', 'headers', 'body')
return {'done', d[1], d[2], d[3]}
