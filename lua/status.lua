-- status: read budgets' limits and counters in the current period windows, in one snapshot.
--
-- KEYS[1] meta hash
-- ARGV: wire.py STATUS_ARGS: ledger_id, budget_ids, run, zones, user (an end user whose legs
--   to show beside its budgets', or ''), model (a model's one name whose per_model legs to show,
--   ALL_MODELS for every model's a budget limits, or ''), [now_ms]
-- Returns {'ok', now_ms, leg status...} or {'ledger_reset'} / {'timezone', ...} /
-- {'clock', now_ms}.
-- Why: the answer a caller reads (remaining_micros, resets_at_ms) must come from the same
-- windows and the same instant that reserve would use.
local a = status_args(ARGV)
a.reading = true
local now = ledger_now(a.now_ms)
local prefix = prefix_of(KEYS[1])
local legs, status = resolve_legs(prefix, a, now)
if status then
  return status
end
local out = {'ok', now}
for _, leg in ipairs(legs) do
  local ck = counter_key(prefix, leg)
  if leg.run and run_stale(ck, now) then
    out[#out + 1] = leg_status(leg, '0', '0', '0')  -- a read writes nothing: Redis drops it
  else
    out[#out + 1] = leg_status(leg, counters(ck))
  end
end
return out
