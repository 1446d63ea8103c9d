-- settle: book the actual cost of a call in the periods its reservation held, not today's.
--
-- KEYS[1] meta hash   KEYS[2] reservation   KEYS[3] open-lease zset
-- ARGV: wire.py SETTLE_ARGS: owner, actual_micros, [now_ms]
-- Returns one of:
--   {'ok', state, expire_policy, reserved_micros}  what it settled: the caller works out what
--     was booked from them by core/lifecycle.py's table, by which it was booked here
--   {'replayed', charged_micros, released_micros, overshoot_micros, late 0|1}  settled before
--   {'not_found'}  {'conflict'} settled before at another actual  {'released'}
-- Alerts (issue 16): each leg's committed spend, as HINCRBY returns it, goes to lib's
-- committed_moved, which emits a threshold event only on a crossing and keeps the hourly bucket.
-- Why: settle and expiry race for one winner. An open lease is settled here in one step. A lease
-- that expiry already resolved is corrected (lib: resolve, by the lifecycle's table). Overshoot
-- is what a settle charged beyond what was held for it, so committed + reserved <= ceiling +
-- overshoot holds for every counter. Only the reservation's owner may settle it: a gateway
-- call's owner is one no API key can present (core/ledger.py GATEWAY_OWNER_PREFIX). No ledger
-- check: the record is the ledger's own, under an id of 128 random bits (or a digest of its
-- owner and Idempotency-Key); a wiped ledger has none, and the caller, told 'not_found', asks
-- whether the ledger's identity is lost.
local a = settle_args(ARGV)
local actual = int(a.actual_micros, 'actual_micros')
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
      settle_effects(state, expire_policy, held, actual)
    reserved = text_of(reserved, held, reserved_micros, actual, a.actual_micros)
    committed = text_of(committed, held, reserved_micros, actual, a.actual_micros)
    overshoot = text_of(overshoot, held, reserved_micros, actual, a.actual_micros)
    local seen
    for budget_id, window_key, ceiling in string.gmatch(legs, '([^ |]+)|([^ |]+)|([^ |]+)[^ ]*') do
      local ck = prefix .. COUNTER_KEY .. budget_id .. '|' .. window_key
      if reserved ~= '0' then redis.call('HINCRBY', ck, 'reserved', reserved) end
      if committed ~= '0' then
        local after = redis.call('HINCRBY', ck, 'committed', committed)
        -- alerts (issue 16): lib committed_moved
        now = committed_moved(prefix, budget_id, window_key, ceiling, after, committed, now, seen)
        seen = budget_id
      end
      if overshoot ~= '0' then redis.call('HINCRBY', ck, 'overshoot', overshoot) end
    end
    -- A gateway call's answer to a resend, its fingerprint '' (core/service.py): in the order
    -- of pack_resolved's parameters (wire.py RESOLVED_FIELDS).
    redis.call('SET', KEYS[2], pack_resolved(
      to, reserved_micros, expire_policy, retention_ms, owner,
      to == 'settled' and a.actual_micros or '', text_of(released, held, reserved_micros, actual, a.actual_micros), overshoot,
      late and '1' or '0', outcome, ''), 'PX', retention_ms)
    redis.call('ZREM', KEYS[3], id_of(prefix, KEYS[2]))
    return {'ok', state, expire_policy, reserved_micros}
  end
end

-- The general case: a record kept whole, one settled or released before, or one kept as a hash.
local rec = load_record(KEYS[2])
if not rec or rec.owner ~= a.owner then
  return {'not_found'}
end
if rec.state == 'settled' then
  if tonumber(rec.actual_micros) ~= actual then
    return {'conflict'}
  end
  return settled_reply(rec)
end
if rec.state == 'released' then
  return {'released'}
end
local state, policy = rec.state, rec.expire_policy
resolve(prefix, KEYS[2], KEYS[3], rec, 'settle', actual, now)
return {'ok', state, policy, rec.reserved_micros}
