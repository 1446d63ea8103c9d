-- key_check: whether a secret is one its key takes now, for authentication.
--
-- KEYS[1] the key's record 'sc:key:{<key_id>}' (a hash; key_put.lua)
-- ARGV: key_hash (hex SHA-256 of the secret), last_used_resolution_ms (the key's last use is
--       written when the stored one is older than this, ms), [now_ms]
-- Returns {'ok', key_id, budget_id, run_ceiling_micros ('' for none), roles (',' between)} when
--   the record names key_hash as its current secret, or as its previous one before
--   grace_ends_at_ms; {'refused'} when there is a record (or a revoked key's) that does not;
--   {'absent'} when there is none.
-- Why: the key id is the authority. A rotation and a revoke each rewrite this one record in one
-- step, so what is taken here is what the last of them left, at the ledger's time (the same
-- Redis TIME a rotation's grace was set by): no secret is taken that its key's record does not
-- name, whichever instance, index entry or race came before. Safe to run twice: it writes
-- only the time of the last use.
local key_hash = ARGV[1]
local resolution_ms = int(ARGV[2], 'last_used_resolution_ms')
local f = redis.call('HMGET', KEYS[1], 'key_hash', 'previous_key_hash', 'grace_ends_at_ms',
                     'key_id', 'budget_id', 'run_ceiling_micros', 'roles', 'last_used_ms',
                     'revoked_at_ms')
if not f[1] then
  return {f[9] and 'refused' or 'absent'}
end
local now = ledger_now(ARGV[3])
if key_hash ~= f[1] and not (key_hash == f[2] and now < tonumber(f[3] or '0')) then
  return {'refused'}
end
if not f[8] or now - tonumber(f[8]) >= resolution_ms then
  redis.call('HSET', KEYS[1], 'last_used_ms', istr(now))
end
return {'ok', f[4], f[5], f[6] or '', f[7] or ''}
