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

-- The common case, written out: an open reservation of a gateway call, settled by its owner,
-- in budgets' legs (no run's), kept only for resends once resolved, so its head is all this
-- reads of it. lib's resolve does the same for every case; this is what it does for this one,
-- without what the others need, since every gateway call takes it.
local stored = redis.pcall('GET', KEYS[2])
if type(stored) == 'string' then
  local state, reserved_micros, expire_policy, retention_ms, owner, legs = record_head(stored)
  if state == 'open' and owner == a.owner and retention_ms == RESEND_WINDOW_MS_TEXT
      and not string.find(legs, '|run', 1, true) then
    local held = tonumber(reserved_micros)
    local to, outcome, reserved, committed, overshoot, released, _, late =
      release_effects(state, expire_policy, held, 0)
    reserved = text_of(reserved, held, reserved_micros, 0, '0')
    committed = text_of(committed, held, reserved_micros, 0, '0')
    overshoot = text_of(overshoot, held, reserved_micros, 0, '0')
    for counter in string.gmatch(legs, '([^ |]+|[^ |]+)[^ ]*') do
      local ck = prefix .. COUNTER_KEY .. counter
      if reserved ~= '0' then redis.call('HINCRBY', ck, 'reserved', reserved) end
      if committed ~= '0' then redis.call('HINCRBY', ck, 'committed', committed) end
      if overshoot ~= '0' then redis.call('HINCRBY', ck, 'overshoot', overshoot) end
    end
    -- A gateway call's answer to a resend, its fingerprint '' (core/service.py): in the order
    -- of pack_resolved's parameters (wire.py RESOLVED_FIELDS).
    redis.call('SET', KEYS[2], pack_resolved(
      to, reserved_micros, expire_policy, retention_ms, owner,
      to == 'settled' and '0' or '', text_of(released, held, reserved_micros, 0, '0'), overshoot,
      late and '1' or '0', outcome, ''), 'PX', retention_ms)
    redis.call('ZREM', KEYS[3], id_of(prefix, KEYS[2]))
    return {'ok', state, expire_policy, reserved_micros}
  end
end

-- The general case: a record kept whole, one resolved before, or one kept as a hash.
local rec = load_record(KEYS[2])
if not rec or rec.owner ~= a.owner then
  return {'not_found'}
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
