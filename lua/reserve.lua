-- reserve: hold the worst case of one call in every budget and period that applies, all or none.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'   KEYS[2] reservation 'sc:{TAG}:r:<id>'
-- KEYS[3] open-lease zset 'sc:{TAG}:open' (score: expires_at_ms)
-- ARGV: wire.py RESERVE_ARGS: ledger_id, reserved_micros, ttl_ms, budget_ids (the path, top
--   scope first, ' ' between), run_budget_id and run_ceiling_micros ('' without a run), zones
--   (lib: zone_windows), expire_policy ('charge'|'release'), retention_ms (how long the record
--   answers repeats once resolved), owner, fingerprint, price_version, model, [now_ms].
-- Returns one of:
--   {'ok', now_ms, leg status...}   the hold asked for, until now_ms + ttl_ms
--   {'replayed', reserved_micros, expires_at_ms, now_ms, leg status...}  the same reservation,
--     still open
--   {'resolved', state, outcome, reserved_micros, charged_micros}  a replay of a reservation
--     that is no longer open
--   {'exceeded'|'busy', now_ms, failing leg status}
--   {'conflict'} same id, other parameters   {'ledger_reset'}   {'no_budget'}
--   {'timezone', budget_id, timezone}   {'clock', now_ms}
-- Why: the check and the hold must be one step, or concurrent calls all pass the same stale
-- check. Expired leases of this tag are reclaimed first (a bounded batch) so a dead worker's
-- hold does not block the budget past its lease. Replaying the same id returns the first answer
-- while the reservation is open (redis-py and the Upstash SDK both resend a script after a lost
-- reply), and what became of it once it is not: never a hold that is gone. The record is
-- written only if none is there (SET NX), which is how a replay is told apart: a fresh id costs
-- no read of its own.
local a = reserve_args(ARGV)
local held = int(a.reserved_micros, 'reserved_micros')
local ttl = int(a.ttl_ms, 'ttl_ms')
if held < 1 then fail('BADARG', 'reserved_micros') end
if ttl < 1 then fail('BADARG', 'ttl_ms') end
if int(a.retention_ms, 'retention_ms') < 1 then fail('BADARG', 'retention_ms') end
if a.expire_policy ~= 'charge' and a.expire_policy ~= 'release' then
  fail('BADARG', 'expire_policy')
end
if a.run_budget_id ~= '' then int(a.run_ceiling_micros, 'run_ceiling_micros') end
local now = ledger_now(a.now_ms)

local prefix = prefix_of(KEYS[1])
local legs, status = resolve_legs(prefix, KEYS[1], a, now)
if status then
  return status
end
if #legs == 0 then
  return {'no_budget'}
end

-- The hold, if every leg has room and no reservation is under this id: its answer. Otherwise
-- nil, and the first leg that refuses with why ('exceeded': its spend leaves no room; 'busy':
-- open holds do), or no leg when a reservation is already under this id.
local function hold()
  local exceeded, busy = nil, nil
  for _, leg in ipairs(legs) do
    leg.key = counter_key(prefix, leg)
    if leg.run and run_stale(leg.key, now) then
      redis.call('DEL', leg.key)  -- an idle run's counter Redis has not dropped yet: a new run
    end
    leg.committed, leg.reserved, leg.overshoot = counters(leg.key)
    local ceiling, committed = tonumber(leg.ceiling_micros), tonumber(leg.committed)
    if committed + held > ceiling then
      exceeded = exceeded or leg
    elseif committed + tonumber(leg.reserved) + held > ceiling then
      busy = busy or leg
    end
  end
  if exceeded or busy then
    return nil, exceeded or busy, exceeded and 'exceeded' or 'busy'
  end
  local state, outcome, reserved = effects('reserve', 'absent', a.expire_policy, held, 0)
  local expires_at = istr(now + ttl)
  local written = redis.call('SET', KEYS[2], pack_record({
    state = state, reserved_micros = a.reserved_micros, expire_policy = a.expire_policy,
    retention_ms = a.retention_ms, owner = a.owner, legs = encode_legs(legs),
    expires_at_ms = expires_at, created_ms = istr(now), fingerprint = a.fingerprint,
    outcome = outcome, price_version = a.price_version, model = a.model,
    -- Expiry resolves the lease long before this (and keeps the record from then on); this
    -- bounds a record that nothing ever resolves, an unknown outcome.
  }), 'PX', istr(ttl + UNKNOWN_OUTCOME_RETENTION_MS), 'NX')
  if not written then
    return nil
  end
  local out, delta = {'ok', now}, istr(reserved)
  for _, leg in ipairs(legs) do
    redis.call('HINCRBY', leg.key, 'reserved', delta)
    if leg.run then
      touch_run(leg.key, now)
    elseif leg.committed == '0' and leg.reserved == '0' and leg.window_key ~= 'total' then
      -- a window's first hold: its counter goes COUNTER_RETENTION_MS after the window ends
      redis.call('PEXPIREAT', leg.key, istr(tonumber(leg.resets_at_ms) + COUNTER_RETENTION_MS))
    end
    out[#out + 1] = leg_status(leg, leg.committed, istr(tonumber(leg.reserved) + reserved),
                               leg.overshoot)
  end
  redis.call('ZADD', KEYS[3], expires_at, id_of(prefix, KEYS[2]))
  return out
end

-- The common case: no lease of the tag has expired, and the hold fits.
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', istr(now), 'LIMIT', '0', '1')
local answer, failing, why
if #due == 0 then
  answer, failing, why = hold()
  if answer then
    return answer
  end
end

-- The general case: expired leases to reclaim first, a budget that refuses, or a reservation
-- already under this id.
if #due > 0 then
  reclaim(prefix, KEYS[3], now, RECLAIM_BATCH_MAX)
  answer, failing, why = hold()
  if answer then
    return answer
  end
end
if failing and redis.call('EXISTS', KEYS[2]) == 0 then
  return {why, now, leg_status(failing, failing.committed, failing.reserved, failing.overshoot)}
end
-- A reservation already under this id: the first answer while it is open, else what became of
-- it; another call under the same id is a conflict.
local prior = load_record(KEYS[2])
if prior.fingerprint ~= a.fingerprint or prior.owner ~= a.owner then
  return {'conflict'}
end
if prior.state ~= 'open' then
  return resolved_reply(prior)
end
local out = {'replayed', prior.reserved_micros, prior.expires_at_ms, now}
for _, leg in ipairs(parse_legs(prior.legs)) do
  out[#out + 1] = leg_status(leg, counters(counter_key(prefix, leg)))
end
return out
