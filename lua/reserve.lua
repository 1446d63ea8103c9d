-- reserve: hold the worst case of one call in every budget and period that applies, all or none.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'   KEYS[2] reservation hash 'sc:{TAG}:r:<id>'
-- KEYS[3] open-lease zset 'sc:{TAG}:open' (score: expires_at_ms)
-- ARGV: ledger_id, now_ms or '', reservation_id, owner, fingerprint, amount_micros, ttl_ms,
--       price_version, model ('' when the caller priced the call), expire_policy
--       ('charge'|'release'), reclaim_batch_max,
--       record_retention_ms, counter_retention_ms, run_idle_ms, then windows
--       (lib: parse_windows), then budgets (lib: resolve_legs).
-- Returns one of:
--   {'ok', id, amount_micros, expires_at_ms, now_ms, replayed 0|1, leg status...}
--   {'resolved', state 's'|'r'|'x', outcome, amount_micros, charged_micros}  a replay of a
--     reservation that is no longer open
--   {'exceeded'|'busy', now_ms, earliest_open_expiry_ms, failing leg status (8 fields)}
--   {'conflict'} same id, other parameters   {'ledger_reset'}   {'no_budget'}
--   {'tz', budget_id, tz}   {'clock', now_ms}
-- Why: the check and the hold must be one step, or concurrent calls all pass the same stale
-- check. Expired leases of this tag are reclaimed first (a bounded batch) so a dead worker's
-- hold does not block the budget past its lease. Replaying the same id returns the first answer
-- while the reservation is open (redis-py and the Upstash SDK both resend a script after a lost
-- reply), and what became of it once it is not: never a hold that is gone.
local now = ledger_now(ARGV[2])
local rid, owner, fp = ARGV[3], ARGV[4], ARGV[5]
local amt = int(ARGV[6], 'amount_micros')
local ttl = int(ARGV[7], 'ttl_ms')
local version, model, policy = ARGV[8], ARGV[9], ARGV[10]
local batch_max = int(ARGV[11], 'reclaim_batch_max')
local retention_ms = int(ARGV[12], 'record_retention_ms')
local counter_retention_ms = int(ARGV[13], 'counter_retention_ms')
local idle_ms = int(ARGV[14], 'run_idle_ms')
if amt < 1 then fail('BADARG', 'amount_micros') end
if ttl < 1 then fail('BADARG', 'ttl_ms') end
if policy ~= 'charge' and policy ~= 'release' then fail('BADARG', 'expire_policy') end
local zones, i = parse_windows(ARGV, 15)

if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])

local prior = redis.call('HMGET', KEYS[2], 'fp', 'owner', 'amt', 'exp', 'legs', 'st', 'outcome',
                         'charged')
if prior[1] then
  if prior[1] ~= fp or prior[2] ~= owner then
    return {'conflict'}
  end
  if prior[6] ~= 'o' then
    return {'resolved', prior[6], prior[7] or '', tonumber(prior[3]),
            charged_of(prior[6], prior[7], prior[3], prior[8])}
  end
  return append({'ok', rid, tonumber(prior[3]), tonumber(prior[4]), now, 1},
                leg_status(prefix, parse_legs(prior[5])))
end

reclaim(prefix, KEYS[3], now, batch_max, retention_ms, idle_ms)

local legs, status = resolve_legs(prefix, ARGV, i, zones, now)
if status then
  return status
end
if #legs == 0 then
  return {'no_budget'}
end

local exceeded, busy = nil, nil
for _, l in ipairs(legs) do
  local ck = counter_key(prefix, l)
  if l.run and run_stale(ck, now, idle_ms) then
    redis.call('DEL', ck)  -- an idle run's counter Redis has not dropped yet: the run is new
  end
  local c, r = counters(ck)
  l.fresh = (c == 0 and r == 0)
  local ceil = tonumber(l.ceil)
  if c + amt > ceil then
    exceeded = exceeded or l
  elseif c + r + amt > ceil then
    busy = busy or l
  end
end
local failing = exceeded or busy
if failing then
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local earliest = 0
  if first[2] then earliest = tonumber(first[2]) end
  local kind = 'busy'
  if exceeded then kind = 'exceeded' end
  return append({kind, now, earliest}, leg_status(prefix, {failing}))
end

local exp = now + ttl
for _, l in ipairs(legs) do
  local ck = counter_key(prefix, l)
  hincr(ck, 'reserved', amt)
  if l.run then
    touch_run(ck, now, idle_ms)
  elseif l.fresh and l.wkey ~= 'total' then
    redis.call('PEXPIREAT', ck, istr(tonumber(l.wend) + counter_retention_ms))
  end
end
redis.call('HSET', KEYS[2], 'st', 'o', 'fp', fp, 'owner', owner, 'amt', ARGV[6],
           'exp', istr(exp), 'ver', version, 'model', model, 'pol', policy, 'legs', encode_legs(legs),
           'created_ms', istr(now))
-- Expiry resolves the lease long before this (and sets the record's retention from then); this
-- bounds a record that nothing ever resolves.
redis.call('PEXPIRE', KEYS[2], istr(ttl + retention_ms))
redis.call('ZADD', KEYS[3], istr(exp), rid)
return append({'ok', rid, amt, exp, now, 0}, leg_status(prefix, legs))
