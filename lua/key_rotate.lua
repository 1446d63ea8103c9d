-- key_rotate: give an API key a new secret; the one it replaces is taken for a grace.
--
-- KEYS[1] the key's record 'sc:key:{<key_id>}' (a hash; key_put.lua)
-- ARGV: key_hash (hex SHA-256 of the new secret), grace_ms (how long the secret it replaces is
--       still taken, ms; 0: not at all), [now_ms]
-- Returns {'rotated', grace_ends_at_ms, dropped_key_hash (the previous secret before this
--   rotation, taken no more; '' for none)}; {'exists'} when the record names key_hash already,
--   as its current or previous secret (a repeat, or a rotation a later one overtook: nothing
--   written); {'revoked'}; {'absent'} (no key).
-- Why: the secrets a key takes are what its one record names, so a rotation is one write here.
-- Of rotations racing on one key each replaces the one before it whole, and after the last
-- exactly its secret is current and one other previous, until grace_ends_at_ms (the ledger's
-- time, which key_check.lua reads too). Safe to run twice.
local key_hash = ARGV[1]
local grace_ms = int(ARGV[2], 'grace_ms')
if key_hash == '' then
  fail('BADARG', 'key_hash')
end
local f = redis.call('HMGET', KEYS[1], 'key_hash', 'previous_key_hash', 'revoked_at_ms')
if not f[1] then
  return {f[3] and 'revoked' or 'absent'}
end
if key_hash == f[1] or key_hash == f[2] then
  return {'exists'}
end
local now = ledger_now(ARGV[3])
if grace_ms > INT_MAX - now then
  fail('BADARG', 'grace_ms')
end
local ends = istr(now + grace_ms)
redis.call('HSET', KEYS[1], 'key_hash', key_hash, 'previous_key_hash', f[1],
           'grace_ends_at_ms', ends, 'rotated_at_ms', istr(now))
return {'rotated', ends, f[2] or ''}
