-- key_put: make an API key, as the one record under its id.
--
-- KEYS[1] the key's record 'sc:key:{<key_id>}' (a hash)
-- ARGV: key_id, key_hash (hex SHA-256 of the current secret), budget_id, run_ceiling_micros
--       ('' for none), roles (',' between), previous_key_hash ('' for none), previous_valid_ms
--       (how much longer the previous secret is taken, ms; 0 for none), created_ms,
--       rotated_at_ms, last_used_ms (instants in ms, '' for none; created_ms '' is now),
--       [now_ms]
-- Returns {'made'}; {'exists'} when the record names key_hash as its current secret already (a
--   repeat: nothing written); {'conflict'} when it holds another secret; {'revoked'} when the
--   key was revoked (key_revoke.lua).
-- Why: the record under the key id is what authentication reads (key_check.lua) and what a
-- rotation and a revoke rewrite (key_rotate.lua, key_revoke.lua), each in one step; a key is made
-- in one step too, so there is never half a key. A new key has no previous secret; a key of an
-- export (or one `ceiling ledger migrate` moves into its record) may. A revoked id is never
-- made again: whatever read a key before it was revoked cannot bring it back.
local key_id, key_hash, budget_id, run_ceiling, roles =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local previous_hash, created, rotated, last_used = ARGV[6], ARGV[8], ARGV[9], ARGV[10]
local previous_valid_ms = int(ARGV[7], 'previous_valid_ms')
if key_id == '' or string.sub(KEYS[1], -#key_id - 2) ~= '{' .. key_id .. '}' then
  fail('BADARG', 'key_id')
end
if key_hash == '' or key_hash == previous_hash then
  fail('BADARG', 'key_hash')
end
if budget_id == '' then
  fail('BADARG', 'budget_id')
end
-- The optional numbers: whole, or '' for none.
for name, value in pairs({run_ceiling_micros = run_ceiling, created_ms = created,
                          rotated_at_ms = rotated, last_used_ms = last_used}) do
  if value ~= '' then
    int(value, name)
  end
end
local now = ledger_now(ARGV[11])
if previous_valid_ms > INT_MAX - now then
  fail('BADARG', 'previous_valid_ms')
end
local found = redis.call('HMGET', KEYS[1], 'key_hash', 'revoked_at_ms')
if found[2] then
  return {'revoked'}
end
if found[1] then
  return {found[1] == key_hash and 'exists' or 'conflict'}
end
redis.call('HSET', KEYS[1], 'key_id', key_id, 'key_hash', key_hash, 'budget_id', budget_id,
           'run_ceiling_micros', run_ceiling, 'roles', roles,
           'created_ms', created ~= '' and created or istr(now))
if previous_hash ~= '' and previous_valid_ms > 0 then
  redis.call('HSET', KEYS[1], 'previous_key_hash', previous_hash,
             'grace_ends_at_ms', istr(now + previous_valid_ms))
end
if rotated ~= '' then
  redis.call('HSET', KEYS[1], 'rotated_at_ms', rotated)
end
if last_used ~= '' then
  redis.call('HSET', KEYS[1], 'last_used_ms', last_used)
end
return {'made'}
