-- status: read budgets' limits and counters in the current period windows, in one snapshot.
--
-- KEYS[1] meta hash
-- ARGV: ledger_id, now_ms or '', run_idle_ms, then windows (lib: parse_windows), then budgets
--       (lib: resolve_legs).
-- Returns {'ok', now_ms, leg status...} or {'ledger_reset'} / {'tz', ...} / {'clock', now_ms}.
-- Why: the answer a caller reads (remaining_micros, resets_at_ms) must come from the same
-- windows and the same instant that reserve would use.
local now = ledger_now(ARGV[2])
local idle_ms = int(ARGV[3], 'run_idle_ms')
local zones, i = parse_windows(ARGV, 4)
if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])
local legs, status = resolve_legs(prefix, ARGV, i, zones, now)
if status then
  return status
end
for _, l in ipairs(legs) do
  if l.run and run_stale(counter_key(prefix, l), now, idle_ms) then
    l.gone = true  -- a read writes nothing: Redis drops the counter itself
  end
end
return append({'ok', now}, leg_status(prefix, legs))
