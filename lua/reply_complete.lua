-- reply_complete: keep the answer of a finished call for the retries of its idempotency key.
--
-- KEYS[1] reply hash 'sc:{TAG}:reply:<digest>'
-- KEYS[2] the API key's quota hash 'sc:{TAG}:q:<owner>' (lib: quota_read)
-- ARGV: token (the attempt that claimed the key), status, headers_json, body, reply_ttl_ms,
--   counted ('1': the answer's bytes count in the key's quota; '0': a small note that the
--   answer was not kept, which the claim's count bounds)
-- Returns {'ok'}; {'lost'} when this attempt no longer holds the key; {'over'} when keeping the
-- answer would take the key past its quota of kept bytes (REPLY_BYTES_PER_KEY_MAX): nothing is
-- written, and the caller keeps a note instead.
-- Why: only the attempt that claimed the key may answer for it; one whose marker expired (it
-- outlived its lease) must not overwrite the call another attempt made since. The bytes are
-- counted where they are written, so no number of concurrent calls passes the bound. Safe to
-- run twice: a resent completion finds its own answer and is 'ok'.
local token = ARGV[1]
local ttl_ms = int(ARGV[5], 'reply_ttl_ms')
if ttl_ms < 1 then fail('BADARG', 'reply_ttl_ms') end

local r = reply_state(KEYS[1])
if r.token ~= token then
  return {'lost'}
end
if r.state == 'in_flight' then
  if ARGV[6] == '1' then
    local now = ledger_now(nil)
    local used = quota_read(KEYS[2], now)
    local size = #ARGV[3] + #ARGV[4]
    if used.reply_bytes + size > REPLY_BYTES_PER_KEY_MAX then
      return {'over'}
    end
    used.reply_bytes = used.reply_bytes + size
    quota_write(KEYS[2], used)
  end
  redis.call('HSET', KEYS[1], 'state', 'done', 'fingerprint', r.fingerprint, 'token', token,
             'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], istr(ttl_ms))
end
return {'ok'}
