-- book: write spend an instance admitted while the ledger was unreachable (its outage journal).
--
-- KEYS[1] meta hash   KEYS[2] reservation hash
-- ARGV: ledger_id, admitted_at_ms, reservation_id, owner, fingerprint, amount_micros,
--       actual_micros, price_version, model, record_retention_ms, counter_retention_ms,
--       run_idle_ms, now_ms or '', then windows (lib: parse_windows), then budgets
--       (lib: resolve_legs).
-- Returns {'ok', replayed 0|1} or {'ledger_reset'} / {'tz', budget_id, tz} / {'no_budget'}.
-- Why: nothing admitted during an outage may be lost. The spend is booked in the periods of the
-- moment it was admitted (the instance's clock: the ledger's was unreachable), unconditionally,
-- since the money is already spent; nothing was held for it, so all of it counts as overshoot.
-- Booking the same journal entry twice (a retried flush) books it once.
local at_ms = int(ARGV[2], 'admitted_at_ms')
local rid, owner, fp = ARGV[3], ARGV[4], ARGV[5]
int(ARGV[6], 'amount_micros')
local actual = int(ARGV[7], 'actual_micros')
local version, model = ARGV[8], ARGV[9]
local retention_ms = int(ARGV[10], 'record_retention_ms')
local counter_retention_ms = int(ARGV[11], 'counter_retention_ms')
local idle_ms = int(ARGV[12], 'run_idle_ms')
-- A run's counter is stamped with the ledger's time, not the admission's: the run was active
-- until the booking at least as far as this ledger knows.
local now = ledger_now(ARGV[13])
local zones, i = parse_windows(ARGV, 14)

if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'ok', 1}
end
local legs, status = resolve_legs(prefix, ARGV, i, zones, at_ms)
if status then
  return status
end
if #legs == 0 then
  return {'no_budget'}
end
for _, l in ipairs(legs) do
  local ck = counter_key(prefix, l)
  if l.run and run_stale(ck, now, idle_ms) then
    redis.call('DEL', ck)
  end
  local c, r = counters(ck)
  hincr(ck, 'committed', actual)
  hincr(ck, 'overshoot', actual)
  if l.run then
    touch_run(ck, now, idle_ms)
  elseif c == 0 and r == 0 and l.wkey ~= 'total' then
    redis.call('PEXPIREAT', ck, istr(tonumber(l.wend) + counter_retention_ms))
  end
end
redis.call('HSET', KEYS[2], 'st', 's', 'fp', fp, 'owner', owner, 'amt', ARGV[6],
           'exp', istr(at_ms), 'ver', version, 'model', model, 'pol', 'charge',
           'legs', encode_legs(legs), 'created_ms', istr(at_ms), 'act', ARGV[7],
           'charged', ARGV[7], 'rel', '0', 'over', ARGV[7], 'late', '1', 'outcome', 'journal')
redis.call('PEXPIRE', KEYS[2], istr(retention_ms))
return {'ok', 0}
