-- drift_alert: one 'ledger.drift' event for a provider's day, the first time it is reported.
--
-- KEYS[1] meta hash of the ledger's own events 'sc:{ledger}:meta' (keys.LEDGER_EVENTS_TAG)
-- ARGV: wire.py DRIFT_ARGS: provider, day (YYYY-MM-DD, UTC), ledger_micros, provider_micros,
--   [now_ms]
-- Returns 1 when this call put the event in the outbox, 0 when the day was reported before.
-- Why: every instance, cron and CLI run can find the same drift; a marker kept as long as a day's
-- spend is (DAILY_SPEND_RETENTION_MS), set in the step that writes the event, makes it one event
-- however many find it, and however often.
local a = drift_args(ARGV)
if a.provider ~= 'openai' and a.provider ~= 'anthropic' then
  fail('BADARG', 'provider')
end
if not string.find(a.day, '^%d%d%d%d%-%d%d%-%d%d$') then
  fail('BADARG', 'day')
end
int(a.ledger_micros, 'ledger_micros')
int(a.provider_micros, 'provider_micros')
local now = ledger_now(a.now_ms)
local prefix = prefix_of(KEYS[1])
local about = 'ledger.drift|' .. a.provider .. '|' .. a.day
if not redis.call('SET', prefix .. DRIFT_MARK_KEY .. a.provider .. '|' .. a.day, '1',
                  'PX', istr(DAILY_SPEND_RETENTION_MS), 'NX') then
  return 0
end
alert_put(prefix, alert_id(about), now, {
  'type', 'ledger.drift', 'budget_id', '', 'period_key', 'day:' .. a.day, 'threshold_pct', '',
  'committed_micros', a.ledger_micros, 'ceiling_micros', '0', 'provider', a.provider,
  'day', a.day, 'ledger_micros', a.ledger_micros, 'provider_micros', a.provider_micros})
return 1
