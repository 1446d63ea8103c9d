-- book_unseen: charge a budget with what a provider billed for a day beyond what the ledger saw.
--
-- KEYS[1] meta hash of the budget's tag 'sc:{TAG}:meta'
-- KEYS[2] what was booked so far for (provider, day) in this tag, a string of micro-dollars
--   'sc:{TAG}:unseen:<provider>|<day>' (core/stores/keys.py unseen_booked)
-- ARGV: wire.py BOOK_UNSEEN_ARGS: ledger_id, budget_ids (the named budget's lineage, top scope
--   first, as a call's path), run (''), zones (of the ledger's now), user (''), provider
--   (one of COST_REPORT_PROVIDERS: core/reconcile.py COST_REPORTS), day (YYYY-MM-DD, UTC),
--   unseen_micros (what the provider billed that day beyond what the ledger saw and any other
--   tag booked, >= 0, decided by core/reconcile.py), [now_ms]
-- Returns {'ok', booked_now_micros, booked_micros}: what this call booked (0 when nothing is new)
--   and what is booked for the day in this tag after it; or {'no_budget'} when the named budget
--   (the last of budget_ids) has no definition; or {'ledger_reset'} / {'timezone', budget_id,
--   timezone} / {'clock', now_ms} as lib's resolve_legs says (the caller asks again).
-- Why: the bill is the ceiling's, not only the traffic the gateway carried. Spend the provider
-- reports that no settle counted (a direct call with the provider's key, its console, a tool
-- that bypassed the gateway) is charged as committed spend into the named budget's current
-- windows that hold the day (every budget on its path: total always, a day, week or month
-- window where it overlaps the day), so the next call that no longer fits is refused; as the
-- day's spend, not this hour's: no velocity alarm watches it. Booking only `unseen - booked so
-- far`, in the step that
-- records the new total, makes it once per (provider, day) however many instances, cron runs and
-- CLI runs find it, and however often: a later report with more spend books only the
-- difference, a repeat books nothing, and nothing here ever lowers a counter. Nothing was held
-- for it, so all of it counts as overshoot (the lifecycle's 'book' row): committed + reserved <=
-- ceiling + overshoot still holds. The mark is kept as long as a day's spend is
-- (DAILY_SPEND_RETENTION_MS from its last write): no run reaches further back.
local a = book_unseen_args(ARGV)
a.reading = true
a.model = ''  -- the bill names no model: no budget's per_model counters are booked
if not COST_REPORT_PROVIDERS[a.provider] then
  fail('BADARG', 'provider')
end
if not string.find(a.day, '^%d%d%d%d%-%d%d%-%d%d$') then
  fail('BADARG', 'day')
end
local unseen = int(a.unseen_micros, 'unseen_micros')
local now = ledger_now(a.now_ms)
local prefix = prefix_of(KEYS[1])
local named = string.match(a.budget_ids, '([^ ]+)$')
if not named or redis.call('EXISTS', prefix .. DEFINITION_KEY .. named) == 0 then
  return {'no_budget'}
end
local found, status = resolve_legs(prefix, a, now)
if status then
  return status
end
-- The day's spend goes into the current windows that hold the day (UTC, [start, end) in ms):
-- total always; a day, week or month window only where it overlaps the day. A past day is not
-- this week's or this month's spend once those have moved on, nor today's.
local y, m, d = string.match(a.day, '^(%d+)-(%d+)-(%d+)$')
y, m, d = tonumber(y), tonumber(m), tonumber(d)
if m <= 2 then y = y - 1 end
local era_year = y - 400 * math.floor(y / 400)
local day_of_year = math.floor((153 * (m > 2 and m - 3 or m + 9) + 2) / 5) + d - 1
local day_start = (math.floor(y / 400) * 146097 + era_year * 365 + math.floor(era_year / 4)
                   - math.floor(era_year / 100) + day_of_year - 719468) * DAY_MS
local starts = {}
for _, z in pairs(zone_windows(a.zones)) do
  starts[z.day_window_key .. '|' .. z.day_resets_at_ms] = z.day_start
  starts[z.week_window_key .. '|' .. z.week_resets_at_ms] = z.week_start
  starts[z.month_window_key .. '|' .. z.month_resets_at_ms] = z.month_start
end
local legs = {}
for _, leg in ipairs(found) do
  local start = starts[leg.window_key .. '|' .. leg.resets_at_ms]
  if leg.window_key == 'total' or (start and start < day_start + DAY_MS
                                   and tonumber(leg.resets_at_ms) > day_start) then
    legs[#legs + 1] = leg
  end
end
local before = redis.call('GET', KEYS[2]) or '0'
local booked = unseen - tonumber(before)
-- The named budget itself must have a window the day is in (its total, or a current window
-- that holds the day): one with only a day limit cannot hold yesterday's spend, and marking the
-- day booked while no counter of it moved would lose the spend for good. Nothing is booked, the
-- mark stays, and the drift keeps showing it.
local holds_day = false
for _, leg in ipairs(legs) do
  holds_day = holds_day or leg.budget_id == named
end
if booked <= 0 or not holds_day then
  return {'ok', '0', before}
end
-- Every counter's committed spend and overshoot stay within INT_MAX, as every other script's
-- money does; checked for all legs before the first write.
for _, leg in ipairs(legs) do
  leg.key = counter_key(prefix, leg)
  leg.committed, leg.reserved, leg.overshoot = counters(leg.key)
  if tonumber(leg.committed) + booked > INT_MAX or tonumber(leg.overshoot) + booked > INT_MAX then
    fail('BADARG', 'unseen_micros')
  end
end
local booked_text, unseen_text = istr(booked), a.unseen_micros
local seen
for _, leg in ipairs(legs) do
  local ck, was_committed, was_reserved = leg.key, leg.committed, leg.reserved
  local after = redis.call('HINCRBY', ck, 'committed', booked_text)
  redis.call('HINCRBY', ck, 'overshoot', booked_text)
  -- alerts: booked spend crosses thresholds like any other, and is counted in the hourly bucket
  -- of the day it was spent in; it is no velocity of this hour's (a velocity alarm watches
  -- spend as calls make it), so it neither fires nor pauses one.
  committed_moved(prefix, leg.budget_id, leg.window_key, leg.ceiling_micros, after, booked_text,
                  now, seen, day_start, false)
  seen = leg.budget_id
  if was_committed == '0' and was_reserved == '0' and leg.window_key ~= 'total' then
    keep_window(prefix, ck, leg.resets_at_ms)
  end
end
redis.call('SET', KEYS[2], unseen_text, 'PX', istr(DAILY_SPEND_RETENTION_MS))
-- One event per amount reached: a repeat of this step writes the same id, a later report with
-- more spend a new one.
alert_put(prefix, alert_id('ledger.unseen_booked|' .. a.provider .. '|' .. a.day .. '|' ..
                           unseen_text), now, {
  'type', 'ledger.unseen_booked', 'budget_id', named, 'period_key', 'day:' .. a.day,
  'threshold_pct', '', 'committed_micros', booked_text, 'ceiling_micros', '0',
  'provider', a.provider, 'day', a.day, 'booked_micros', booked_text})
return {'ok', booked_text, unseen_text}
