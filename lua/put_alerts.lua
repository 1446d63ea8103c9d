-- put_alerts: a budget's alert settings, put right after its definition.
--
-- KEYS[1] meta hash   KEYS[2] definition hash 'sc:{TAG}:def:<budget_id>'
-- ARGV: budget_id, thresholds_pct (ascending whole percents, ' ' between, '' for none),
--       velocity ('window_s,max_micros,max_rate_multiple_milli,pause' or '' for none)
-- Returns {'ok'} or {'no_budget'}.
-- Why: a settle learns which budgets of its tag have a velocity alarm from one field of the meta
-- hash it holds the key of (VELOCITY_FIELD: ' budget_id,<velocity>' per budget), and reads a
-- budget's thresholds only when its spend moved a whole percent, so both are written here, where
-- a budget is put, and nowhere on a call's path. Safe to run twice: it writes what it is given.
local budget_id, thresholds, velocity = ARGV[1], ARGV[2], ARGV[3]
if string.find(thresholds, '[^%d ]') or string.find(velocity, '[^%d,]') then
  fail('BADARG', 'alerts')
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'no_budget'}
end
redis.call('HSET', KEYS[2], 'alert_thresholds_pct', thresholds, 'alert_velocity', velocity)
local alarms = redis.call('HGET', KEYS[1], VELOCITY_FIELD) or ''
local mine = ' ' .. budget_id .. ','
local at = string.find(alarms, mine, 1, true)
if at then
  local stop = string.find(alarms, ' ', at + 1, true)
  alarms = string.sub(alarms, 1, at - 1) .. (stop and string.sub(alarms, stop) or '')
end
if velocity ~= '' then
  alarms = alarms .. mine .. velocity
end
if alarms == '' then
  redis.call('HDEL', KEYS[1], VELOCITY_FIELD)
else
  redis.call('HSET', KEYS[1], VELOCITY_FIELD, alarms)
end
return {'ok'}
