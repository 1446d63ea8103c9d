-- put_budget: create or replace one budget, whole: its definition, its alert settings and its
-- entries in the operators' catalogue; spend already booked stays.
--
-- KEYS[1] meta hash   KEYS[2] definition hash 'sc:{TAG}:def:<budget_id>'
--   KEYS[3] the catalogue's organisations hash, KEYS[4] its budget ids (core/stores/keys.py
--   ORGS_KEY, BUDGETS_KEY): given where one script may reach the catalogue's slot; not on a
--   Redis Cluster, where the caller writes both after this script
--   (core/stores/scripted_catalogue.py put_budget says why that order)
-- ARGV: ledger_id, budget_id, timezone, outage_allowance_micros,
--   thresholds_pct (ascending whole percents, ' ' between, '' for none),
--   velocity ('window_s,max_micros,max_rate_multiple_milli,pause', '' for none),
--   then (period, ceiling_micros) pairs, then ('rate', wire.py rate_field) and
--   ('per_user', wire.py per_user_field), ('models_allow', wire.py models_allow_field) and
--   ('per_model', wire.py per_model_field) when given, and ('clamp', '1') for a budget whose
--   gateway calls are clamped to its room. A budget with models_allow or per_model carries
--   the models flag in its rate (wire.py rate_field), which is how a reserve knows to read them,
--   and one without carries none: checked here. Its ledger id is followed by
--   MODELS_LEDGER_SUFFIX, so that a version that does not know models refuses its calls.
-- Returns {'ok'} or {'ledger_reset'}.
-- Why one script: a budget half put is enforced wrongly (new limits beside the old velocity
-- alarm, or none of the alarm it asked for, which is what pauses it). Everything is checked before
-- the first write, so a refused put writes nothing; it writes what it is given, so running it
-- twice is running it once. The first budget of a tag stamps the tag with the ledger id, which
-- every other script checks; a tag stamped with another id belongs to a ledger this instance does
-- not know. The definition is written whole under wire.py DEFINITION_FIELDS' names with the
-- ledger id, which a reserve checks there, in the read it makes anyway. A settle learns which
-- budgets of its tag have a velocity alarm from one field of the meta hash (VELOCITY_FIELD:
-- ' budget_id,<velocity>' per budget), and reads a budget's thresholds only when its spend moved
-- a whole percent, so both are written here and nowhere on a call's path.
local CEILING_FIELDS = {day = DEFINITION_FIELDS[4], month = DEFINITION_FIELDS[5],
                        total = DEFINITION_FIELDS[6], week = DEFINITION_FIELDS[8]}
-- The shape of each: whole numbers ('-' for a period per_user does not limit), checked here as
-- everything a script keeps is, since the reserve script reads them as they are.
-- A model's name is wire.py's (core/budgets.py is_model_name); per_model's entries are checked
-- by what is left once they are taken out (nothing), as Lua patterns repeat no group.
local SETTINGS = {rate = '^%d+ %d+$',
                  per_user = '^%d+ [01] %d+ %d+ [%d-]+ [%d-]+ [%d-]+ [%d-]+$',
                  models_allow = '^ [%w._:@+/ -]+ $', per_model = '^ '}
local PER_MODEL_ENTRY = ' [%w._:@+-]+|[%d-]+|[%d-]+|[%d-]+|[%d-]+'
local function settled(name, value)
  if name == 'per_model' then
    return string.gsub(value, PER_MODEL_ENTRY, '') == ''
  elseif name == 'rate' and string.find(value, '^%d+ %d+ ' .. MODELS_FLAG .. '$') then
    return true
  end
  return string.find(value, SETTINGS[name]) ~= nil
end
local ledger_id, budget_id, thresholds, velocity = ARGV[1], ARGV[2], ARGV[5], ARGV[6]
if string.find(thresholds, '[^%d ]') or string.find(velocity, '[^%d,]') then
  fail('BADARG', 'alerts')
end
local allowance = int(ARGV[4], 'outage_allowance_micros')
local fields = {DEFINITION_FIELDS[1], ledger_id, DEFINITION_FIELDS[2], ARGV[3],
                DEFINITION_FIELDS[3], istr(allowance),
                'alert_thresholds_pct', thresholds, 'alert_velocity', velocity}
local i = 7
local limits = 0
local flagged, models = false, false
while ARGV[i] do
  local field, shape = CEILING_FIELDS[ARGV[i]], SETTINGS[ARGV[i]]
  if field then
    fields[#fields + 1] = field
    fields[#fields + 1] = istr(int(ARGV[i + 1], 'ceiling_micros'))
    limits = limits + 1
  elseif ARGV[i] == 'clamp' and ARGV[i + 1] == '1' then
    -- Read by the gateway on a refusal only; a script that does not know it loses nothing.
    fields[#fields + 1] = 'clamp'
    fields[#fields + 1] = '1'
  elseif shape and settled(ARGV[i], ARGV[i + 1]) then
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[i + 1]
    if ARGV[i] == 'rate' then
      flagged = has_models(ARGV[i + 1])
    elseif ARGV[i] == 'models_allow' or ARGV[i] == 'per_model' then
      models = true
    end
  else
    fail('BADARG', 'period')
  end
  i = i + 2
end
if limits == 0 then fail('BADARG', 'limits') end
if flagged ~= models then fail('BADARG', 'models') end
if models then
  fields[2] = ledger_id .. MODELS_LEDGER_SUFFIX  -- wire.py MODELS_LEDGER_SUFFIX: why
end

local stamped = redis.call('HGET', KEYS[1], 'ledger')
if stamped and stamped ~= ledger_id then
  return {'ledger_reset'}
end
if not stamped then
  redis.call('HSET', KEYS[1], 'ledger', ledger_id)
end
-- A pause and its time stay through a put: only `ceiling budgets resume` lifts it.
local paused = redis.call('HMGET', KEYS[2], 'paused', 'paused_at_ms')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
if paused[1] then
  redis.call('HSET', KEYS[2], 'paused', paused[1], 'paused_at_ms', paused[2] or '0')
end

-- This budget's entry in the tag's list of velocity alarms: its old one out, its new one in.
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

if KEYS[3] then
  -- After the stamp: an organisation named here has data under this ledger id to lose.
  redis.call('HSET', KEYS[3], string.match(budget_id, '^[^/]+'), ledger_id)
  redis.call('ZADD', KEYS[4], 0, budget_id)
end
return {'ok'}
