-- key_revoke: revoke an API key: no secret of it is taken any more, nor is its id made again.
--
-- KEYS[1] the key's record 'sc:key:{<key_id>}' (a hash; key_put.lua)
-- ARGV: [now_ms]
-- Returns {'revoked', key_hash, previous_key_hash ('' for none), budget_id}: the hashes of the
--   secrets it took (core/stores/scripted_keys.py deletes the entries under them that name the
--   key, core/stores/keys.py api_key) and the budget it was listed under; {'absent'} when
--   there was no key to revoke: none, or one revoked before (a repeat).
-- Why: one write ends every secret of the key at once, whatever rotation ran before it; one
-- after it answers 'revoked'. The record keeps revoked_at_ms alone, for ever (a key is made by
-- an operator, and so is this): whatever read the key before this ran cannot make it again
-- (key_put.lua refuses a revoked id). Safe to run twice.
local f = redis.call('HMGET', KEYS[1], 'key_hash', 'previous_key_hash', 'budget_id',
                     'revoked_at_ms')
if f[4] then
  return {'absent'}
end
local now = ledger_now(ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'revoked_at_ms', istr(now))
if not f[1] then
  return {'absent'}
end
return {'revoked', f[1], f[2] or '', f[3] or ''}
