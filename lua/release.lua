-- release: give back a reservation whose call provably never reached the provider.
--
-- KEYS[1] meta hash   KEYS[2] reservation   KEYS[3] open-lease zset
-- ARGV: wire.py RELEASE_ARGS: owner, [now_ms]
-- Returns one of:
--   {'ok', state, expire_policy, reserved_micros}  what it released (as settle.lua answers)
--   {'replayed', released_micros}   {'not_found'}   {'settled'}
-- Why: a release is a settle at zero that also says "nothing was billed". If expiry charged the
-- lease already, the release refunds that charge (lib: resolve, by the lifecycle's table);
-- releasing twice returns the first answer. No ledger check, as in settle.lua.
local a = release_args(ARGV)
local now = a.now_ms and ledger_now(a.now_ms)
local prefix = prefix_of(KEYS[1])

-- The common case, an open gateway call resolved by its owner, is answered at once; the general
-- case is a record kept whole, or one resolved before (lib: resolve_or_load).
local answer, rec
answer, rec, now = resolve_or_load(prefix, KEYS, a.owner, release_effects, 0, '0', now)
if answer then
  return answer
end
if rec.state == 'settled' then
  return {'settled'}
end
if rec.state == 'released' then
  return {'replayed', rec.released_micros}
end
local state, policy = rec.state, rec.expire_policy
resolve(prefix, KEYS[2], KEYS[3], rec, 'release', 0, now)
return {'ok', state, policy, rec.reserved_micros}
