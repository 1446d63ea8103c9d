-- put_budget: create or replace one budget's definition; spend already booked stays.
--
-- KEYS[1] meta hash   KEYS[2] definition hash 'sc:{TAG}:def:<budget_id>'
-- ARGV: ledger_id, timezone, outage_allowance_micros, then (period, ceiling_micros) pairs, then
--   ('rate', wire.py rate_field) and ('per_user', wire.py per_user_field) when given, and
--   ('clamp', '1') for a budget whose gateway calls are clamped to its room
-- Returns {'ok'} or {'ledger_reset'}.
-- Why: the first budget of a tag stamps the tag with the ledger id, which every other script
-- checks. A tag stamped with another id belongs to a ledger this instance does not know. The
-- definition is written whole under wire.py DEFINITION_FIELDS' names, with the ledger id (which
-- a reserve checks there, in the read it makes anyway).
local CEILING_FIELDS = {day = DEFINITION_FIELDS[4], month = DEFINITION_FIELDS[5],
                        total = DEFINITION_FIELDS[6], week = DEFINITION_FIELDS[8]}
-- The shape of each: whole numbers ('-' for a period per_user does not limit), checked here as
-- everything a script keeps is, since the reserve script reads them as they are.
local SETTINGS = {rate = '^%d+ %d+$',
                  per_user = '^%d+ [01] %d+ %d+ [%d-]+ [%d-]+ [%d-]+ [%d-]+$'}
local allowance = int(ARGV[3], 'outage_allowance_micros')
local fields = {DEFINITION_FIELDS[1], ARGV[1], DEFINITION_FIELDS[2], ARGV[2],
                DEFINITION_FIELDS[3], istr(allowance)}
local i = 4
local limits = 0
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
  elseif shape and string.find(ARGV[i + 1], shape) then
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[i + 1]
  else
    fail('BADARG', 'period')
  end
  i = i + 2
end
if limits == 0 then fail('BADARG', 'limits') end

local stamped = redis.call('HGET', KEYS[1], 'ledger')
if stamped and stamped ~= ARGV[1] then
  return {'ledger_reset'}
end
if not stamped then
  redis.call('HSET', KEYS[1], 'ledger', ARGV[1])
end
-- A pause and its time stay through a put: only `ceiling budgets resume` lifts it.
local paused = redis.call('HMGET', KEYS[2], 'paused', 'paused_at_ms')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
if paused[1] then
  redis.call('HSET', KEYS[2], 'paused', paused[1], 'paused_at_ms', paused[2] or '0')
end
return {'ok'}
